package kvevents

import (
	"bufio"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"strconv"
	"time"

	"github.com/go-zeromq/zmq4"

	"github.com/loxilb-llm/loxilb/pkg/rawio"
)

// zmtpPeer is one ZMTP connection the package dials: a SUB to a publisher
// or a DEALER to its replay ROUTER. zmq4's Conn does the handshake and the
// sends, without a zmq4 Socket, so the goroutine that dialled the peer is
// the only one that ever reads from it: a zmq4 Socket reads each
// connection in a goroutine of its own, where neither a recover nor our
// limits could reach. After the handshake messages are read by
// zmtpReader, not by zmq4: zmq4 issues a read syscall for every frame
// header and body and allocates every body, which made socket reads most
// of the cost of a small event batch. The reader reads a TCP socket
// through pkg/rawio.
type zmtpPeer struct {
	zc   *zmq4.Conn
	rd   *zmtpReader
	raw  net.Conn
	stop func() bool
}

// dialZMTP connects to endpoint ("tcp://host:port") as a socket of type typ
// and completes the ZMTP handshake within the dial timeout. The connection
// is closed when ctx ends.
func dialZMTP(ctx context.Context, endpoint string, typ zmq4.SocketType, cfg *Config) (*zmtpPeer, error) {
	host, port, err := splitTCP(endpoint)
	if err != nil {
		return nil, err
	}
	d := net.Dialer{Timeout: cfg.DialTimeout}
	raw, err := d.DialContext(ctx, "tcp", net.JoinHostPort(host, strconv.Itoa(port)))
	if err != nil {
		return nil, err
	}
	stop := context.AfterFunc(ctx, func() { _ = raw.Close() })
	// A peer that accepts and then stalls must not hold the handshake.
	_ = raw.SetDeadline(time.Now().Add(cfg.DialTimeout))
	p, err := openZMTP(raw, typ, zmtpLimits{maxMessage: uint64(cfg.MaxMessageBytes), maxFrames: cfg.MaxMessageFrames})
	if err != nil {
		stop()
		_ = raw.Close()
		return nil, fmt.Errorf("ZMTP handshake with %s: %w", endpoint, err)
	}
	_ = raw.SetDeadline(time.Time{})
	p.stop = stop
	return p, nil
}

// openZMTP runs the ZMTP handshake over conn as a socket of type typ. The
// handshake is read by zmq4 through a limitConn; zmq4 reads exactly the
// bytes of the greeting and the READY command, so the stream is at a frame
// boundary when the zmtpReader takes over.
func openZMTP(conn net.Conn, typ zmq4.SocketType, lim zmtpLimits) (*zmtpPeer, error) {
	lc := &limitConn{Conn: conn, sc: newZMTPScanner(lim)}
	zc, err := zmq4.Open(lc, zmtpNull{}, typ, nil, false, nil)
	if err != nil {
		return nil, err
	}
	var src io.Reader = conn
	if rc := rawio.New(conn); rc != nil {
		// Reads without the scheduler's system-call hand-off: on a busy
		// host the hand-off's thread wakeups cost about as much as the
		// read itself.
		src = rc
	}
	return &zmtpPeer{zc: zc, rd: newZMTPReader(src, lim), raw: conn, stop: func() bool { return false }}, nil
}

// recv returns the next data message. Its frames alias the reader's
// buffer and are valid until the next recv. PING is answered; other
// commands are skipped.
func (p *zmtpPeer) recv() ([][]byte, error) {
	for {
		frames, cmd, err := p.rd.next()
		if err != nil {
			return nil, err
		}
		if !cmd {
			return frames, nil
		}
		if err := p.command(frames[0]); err != nil {
			return nil, err
		}
	}
}

// command handles one command frame [name-len, name, body]: a PING gets
// its PONG, carrying the PING's context as ZMTP 3.1 asks; anything else
// (a peer's ERROR, an unknown command) is ignored, as zmq4 did.
func (p *zmtpPeer) command(c []byte) error {
	if len(c) == 0 || int(c[0]) > len(c)-1 {
		return fmt.Errorf("%w: malformed command of %d bytes", ErrBadFraming, len(c))
	}
	name, body := c[1:1+int(c[0])], c[1+int(c[0]):]
	if string(name) != zmq4.CmdPing {
		return nil
	}
	// PING is [TTL (2 bytes), context (at most 16 bytes)].
	var ctx []byte
	if len(body) > 2 {
		ctx = body[2:min(len(body), 2+16)]
	}
	return p.zc.SendCmd(zmq4.CmdPong, ctx)
}

// send writes one multi-frame message.
func (p *zmtpPeer) send(frames ...[]byte) error {
	return p.zc.SendMsg(zmq4.NewMsgFrom(frames...))
}

func (p *zmtpPeer) close() {
	p.stop()
	_ = p.raw.Close()
}

// zmtpReadBuffer is the socket read buffer: a burst of small event
// messages is read with one syscall. Bodies larger than it are read
// straight into the message buffer.
const zmtpReadBuffer = 64 << 10

// zmtpKeepMessage bounds the message buffer kept between messages; a rare
// larger message is not held for the life of the connection.
const zmtpKeepMessage = 1 << 20

// zmtpReader reads ZMTP 3 frames from a peer after the handshake. Every
// header is checked against the framing rules and the limits
// (zmtpLimits.check) before its body is read or anything is sized from
// it. The bodies of one message are read back to back into one reused
// buffer, so steady-state reading allocates nothing.
type zmtpReader struct {
	br     *bufio.Reader
	lim    zmtpLimits
	buf    []byte
	ends   []int
	frames [][]byte
	long   [8]byte // a long size, here so it does not escape per read
}

func newZMTPReader(r io.Reader, lim zmtpLimits) *zmtpReader {
	return &zmtpReader{br: bufio.NewReaderSize(r, zmtpReadBuffer), lim: lim}
}

// next reads one message. cmd reports a command, which is then the only
// frame. The frames alias the reader's buffer until the next call. An
// error ends the connection: after a refused header the stream cannot be
// resynchronised.
func (r *zmtpReader) next() (frames [][]byte, cmd bool, err error) {
	if cap(r.buf) > zmtpKeepMessage {
		r.buf = nil
	}
	r.buf, r.ends = r.buf[:0], r.ends[:0]
	for more := true; more; {
		fl, size, err := r.header(uint64(len(r.buf)), len(r.ends))
		if err != nil {
			if len(r.ends) > 0 && errors.Is(err, io.EOF) {
				err = io.ErrUnexpectedEOF
			}
			return nil, false, err
		}
		cmd, more = fl&zmtpFlagCommand != 0, fl&zmtpFlagMore != 0
		// size is at most maxMessage minus the bytes already held.
		n := len(r.buf)
		r.buf = growExact(r.buf, int(size), int(r.lim.maxMessage))[:n+int(size)]
		if _, err := io.ReadFull(r.br, r.buf[n:]); err != nil {
			return nil, false, noEOF(err)
		}
		r.ends = append(r.ends, len(r.buf))
	}
	// Frames are cut only now: the buffer may have moved while growing.
	r.frames = r.frames[:0]
	lo := 0
	for _, hi := range r.ends {
		r.frames = append(r.frames, r.buf[lo:hi:hi])
		lo = hi
	}
	return r.frames, cmd, nil
}

// header reads and checks one frame header, given the body bytes and
// frames of its message so far.
func (r *zmtpReader) header(msgBytes uint64, msgFrames int) (fl byte, size uint64, err error) {
	fl, err = r.br.ReadByte()
	if err != nil {
		return 0, 0, err
	}
	if err := zmtpCheckFlags(fl); err != nil {
		return 0, 0, err
	}
	if fl&zmtpFlagLong != 0 {
		if _, err := io.ReadFull(r.br, r.long[:]); err != nil {
			return 0, 0, noEOF(err)
		}
		size = binary.BigEndian.Uint64(r.long[:])
	} else {
		c, err := r.br.ReadByte()
		if err != nil {
			return 0, 0, noEOF(err)
		}
		size = uint64(c)
	}
	return fl, size, r.lim.check(fl, size, msgBytes, msgFrames)
}

// noEOF turns an end of stream inside a frame into io.ErrUnexpectedEOF.
func noEOF(err error) error {
	if err == io.EOF {
		return io.ErrUnexpectedEOF
	}
	return err
}
