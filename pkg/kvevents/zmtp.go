package kvevents

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"strings"

	"github.com/go-zeromq/zmq4"
)

// ErrInputTooLarge is returned (wrapped) when a ZMQ peer announces a frame
// or message larger than Config.MaxMessageBytes, or more frames in one
// message than Config.MaxMessageFrames, and when a TensorRT-LLM drain body
// exceeds Config.TRTMaxBody. The connection is dropped before anything is
// sized from the announcement.
var ErrInputTooLarge = errors.New("KV event input over the size limit")

// ErrBadFraming is returned (wrapped) when a ZMQ peer sends bytes that are
// not ZMTP 3 framing (reserved flag bits, a command split over frames, a
// malformed READY).
var ErrBadFraming = errors.New("bad ZMTP framing")

// ZMTP 3 framing (https://rfc.zeromq.org/spec/23/): a 64-byte greeting,
// then frames [flags][size: 1 byte, or 8 bytes big-endian when LONG][body].
const (
	zmtpGreetingLen = 64
	zmtpFlagMore    = 0x01
	zmtpFlagLong    = 0x02
	zmtpFlagCommand = 0x04
	zmtpFlagsKnown  = zmtpFlagMore | zmtpFlagLong | zmtpFlagCommand
	// zmtpMaxCommand bounds one command frame (READY with its metadata,
	// PING, ERROR). libzmq's largest, READY, holds a socket type and an
	// identity of at most 255 bytes.
	zmtpMaxCommand = 64 << 10
)

// zmtpLimits bounds what one ZMQ peer can make the subscriber allocate.
type zmtpLimits struct {
	// maxMessage bounds the sum of the frame bodies of one message.
	maxMessage uint64
	// maxFrames bounds the frames of one message.
	maxFrames int
}

// zmtpScanner follows the ZMTP stream a peer sends and refuses a frame
// whose announced size breaks the limits. It sees every byte before zmq4
// does: zmq4's Conn allocates each frame body at the size its header
// announces (make([]byte, size)), so a header claiming 2^40 or 2^62 bytes
// would kill the process if it reached zmq4.
type zmtpScanner struct {
	lim zmtpLimits

	greeting int // greeting bytes still expected
	hdr      [9]byte
	hdrN     int    // header bytes seen
	body     uint64 // body bytes of the current frame still expected
	more     bool   // the current frame has the MORE flag

	msgBytes  uint64 // body bytes of the current message so far
	msgFrames int    // frames of the current message so far
}

func newZMTPScanner(lim zmtpLimits) *zmtpScanner {
	return &zmtpScanner{lim: lim, greeting: zmtpGreetingLen}
}

// scan consumes the next bytes of the stream. It fails on the first header
// that breaks the framing or the limits; the stream must then be dropped.
func (z *zmtpScanner) scan(p []byte) error {
	for len(p) > 0 {
		switch {
		case z.greeting > 0:
			n := min(z.greeting, len(p))
			z.greeting -= n
			p = p[n:]
		case z.body > 0:
			n := uint64(len(p))
			if n > z.body {
				n = z.body
			}
			z.body -= n
			p = p[n:]
			if z.body == 0 {
				z.endFrame()
			}
		default:
			z.hdr[z.hdrN] = p[0]
			z.hdrN++
			p = p[1:]
			if err := z.header(); err != nil {
				return err
			}
		}
	}
	return nil
}

// header checks a frame header once its last byte has arrived.
func (z *zmtpScanner) header() error {
	fl := z.hdr[0]
	if err := zmtpCheckFlags(fl); err != nil {
		return err
	}
	want := 2
	if fl&zmtpFlagLong != 0 {
		want = 9
	}
	if z.hdrN < want {
		return nil
	}
	z.hdrN = 0
	var size uint64
	if want == 2 {
		size = uint64(z.hdr[1])
	} else {
		size = binary.BigEndian.Uint64(z.hdr[1:9])
	}
	z.more = fl&zmtpFlagMore != 0
	if err := z.lim.check(fl, size, z.msgBytes, z.msgFrames); err != nil {
		return err
	}
	z.msgBytes += size
	z.msgFrames++
	z.body = size
	if size == 0 {
		z.endFrame()
	}
	return nil
}

// zmtpCheckFlags refuses a frame flags byte with reserved bits set; it is
// checked as soon as the byte arrives, before the size is read.
func zmtpCheckFlags(fl byte) error {
	if fl&^zmtpFlagsKnown != 0 {
		return fmt.Errorf("%w: frame flags 0x%02x set reserved bits", ErrBadFraming, fl)
	}
	return nil
}

// check refuses a frame (flags fl, announced body size) that breaks the
// framing or the limits, given the body bytes and frames of its message
// so far. It runs before anything is sized from the announcement.
func (l zmtpLimits) check(fl byte, size, msgBytes uint64, msgFrames int) error {
	cmd, more := fl&zmtpFlagCommand != 0, fl&zmtpFlagMore != 0
	switch {
	case cmd && more:
		return fmt.Errorf("%w: command frame with the MORE flag", ErrBadFraming)
	case cmd && msgFrames > 0:
		return fmt.Errorf("%w: command frame inside a multi-frame message", ErrBadFraming)
	case cmd && size > zmtpMaxCommand:
		return fmt.Errorf("%w: command frame of %d bytes, limit %d", ErrInputTooLarge, size, zmtpMaxCommand)
	case size > l.maxMessage-msgBytes:
		return fmt.Errorf("%w: frame of %d bytes after %d in the message, limit %d", ErrInputTooLarge, size, msgBytes, l.maxMessage)
	case msgFrames+1 > l.maxFrames:
		return fmt.Errorf("%w: more than %d frames in one message", ErrInputTooLarge, l.maxFrames)
	}
	return nil
}

func (z *zmtpScanner) endFrame() {
	if !z.more {
		z.msgBytes, z.msgFrames = 0, 0
	}
}

// limitConn is the net.Conn zmq4 reads through: every byte read is scanned
// before it is returned, and a read that would hand zmq4 an oversized
// header fails instead (and so does every later read). Only the goroutine
// that owns the zmtpPeer reads it.
type limitConn struct {
	net.Conn
	sc  *zmtpScanner
	err error
}

func (c *limitConn) Read(p []byte) (int, error) {
	if c.err != nil {
		return 0, c.err
	}
	n, err := c.Conn.Read(p)
	if serr := c.sc.scan(p[:n]); serr != nil {
		c.err = serr
		// Drop the peer now: nothing more of it is read.
		_ = c.Conn.Close()
		return 0, serr
	}
	return n, err
}

// zmtpNull is the ZMTP NULL security mechanism, with a bounds-checked
// parser of the peer's READY metadata (zmq4's own parser indexes past the
// end of a malformed READY).
type zmtpNull struct{}

var _ zmq4.Security = zmtpNull{}

func (zmtpNull) Type() zmq4.SecurityType { return zmq4.NullSecurity }

func (zmtpNull) Handshake(conn *zmq4.Conn, _ bool) error {
	raw, err := conn.Meta.MarshalZMTP()
	if err != nil {
		return fmt.Errorf("marshal metadata: %w", err)
	}
	if err := conn.SendCmd(zmq4.CmdReady, raw); err != nil {
		return fmt.Errorf("send READY: %w", err)
	}
	cmd, err := conn.RecvCmd()
	if err != nil {
		return fmt.Errorf("receive READY: %w", err)
	}
	if cmd.Name != zmq4.CmdReady {
		return fmt.Errorf("%w: peer sent %q instead of READY", ErrBadFraming, cmd.Name)
	}
	if err := parseZMTPMetadata(cmd.Body, conn.Peer.Meta); err != nil {
		return err
	}
	// zmq4 panics on a socket type it does not know; only the peers this
	// package talks to are let through.
	ours, peer := conn.Meta["Socket-Type"], conn.Peer.Meta["Socket-Type"]
	if !zmtpPeerOK(ours, peer) {
		return fmt.Errorf("%w: peer socket type %q cannot serve a %s", ErrBadFraming, peer, ours)
	}
	return nil
}

// zmtpPeerOK reports whether a peer of type peer may serve our socket type.
func zmtpPeerOK(ours, peer string) bool {
	switch zmq4.SocketType(ours) {
	case zmq4.Sub:
		return peer == string(zmq4.Pub) || peer == string(zmq4.XPub)
	case zmq4.Dealer:
		return peer == string(zmq4.Router) || peer == string(zmq4.Dealer) || peer == string(zmq4.Rep)
	}
	return false
}

func (zmtpNull) Encrypt(w io.Writer, data []byte) (int, error) { return w.Write(data) }
func (zmtpNull) Decrypt(w io.Writer, data []byte) (int, error) { return w.Write(data) }

// parseZMTPMetadata reads READY properties (name-len, name, 4-byte
// value-len, value)* into md. Socket-Type and Identity are stored under
// the spelling zmq4 looks them up with.
func parseZMTPMetadata(p []byte, md zmq4.Metadata) error {
	for len(p) > 0 {
		kl := int(p[0])
		p = p[1:]
		if kl == 0 || kl+4 > len(p) {
			return fmt.Errorf("%w: truncated READY property", ErrBadFraming)
		}
		k := string(p[:kl])
		vl := binary.BigEndian.Uint32(p[kl:])
		p = p[kl+4:]
		if uint64(vl) > uint64(len(p)) {
			return fmt.Errorf("%w: READY property %q value runs past the command", ErrBadFraming, k)
		}
		switch {
		case strings.EqualFold(k, "Socket-Type"):
			k = "Socket-Type"
		case strings.EqualFold(k, "Identity"):
			k = "Identity"
		}
		md[k] = string(p[:vl])
		p = p[vl:]
	}
	return nil
}
