package kvevents

import (
	"bytes"
	"errors"
	"io"
	"runtime"
	"testing"

	"github.com/go-zeromq/zmq4"
)

// recConn is a memConn that records what the subscriber writes.
type recConn struct {
	memConn
	w bytes.Buffer
}

func (c *recConn) Write(p []byte) (int, error) { return c.w.Write(p) }

func TestZMTPReaderMessagesAndRefusals(t *testing.T) {
	lim := zmtpLimits{maxMessage: 4096, maxFrames: 3}
	valid := zmtpFrames([]byte("topic"), seqFrame(7), bytes.Repeat([]byte{0xab}, 300))
	cases := []struct {
		name   string
		stream []byte
		want   error // nil: the valid message, then io.EOF
	}{
		{"valid", valid, nil},
		{"huge announced frame", longFrameHeader(0, 1<<62), ErrInputTooLarge},
		{"message over the limit", append(append(longFrameHeader(zmtpFlagMore, 4000), make([]byte, 4000)...), longFrameHeader(0, 200)...), ErrInputTooLarge},
		{"too many frames", zmtpFrames(nil, nil, nil, nil), ErrInputTooLarge},
		{"reserved flag bits", []byte{0x80, 0}, ErrBadFraming},
		{"command with MORE", []byte{zmtpFlagCommand | zmtpFlagMore, 0}, ErrBadFraming},
		{"command inside a message", []byte{zmtpFlagMore, 0, zmtpFlagCommand, 0}, ErrBadFraming},
		{"truncated body", valid[:len(valid)-1], io.ErrUnexpectedEOF},
		{"truncated message", valid[:2+5], io.ErrUnexpectedEOF},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			r := newZMTPReader(bytes.NewReader(tc.stream), lim)
			var ms0, ms1 runtime.MemStats
			runtime.ReadMemStats(&ms0)
			frames, cmd, err := r.next()
			runtime.ReadMemStats(&ms1)
			if tc.want != nil {
				if !errors.Is(err, tc.want) {
					t.Fatalf("err = %v, want %v", err, tc.want)
				}
				// Nothing is sized from a refused announcement.
				if grew := ms1.TotalAlloc - ms0.TotalAlloc; grew > 1<<20 {
					t.Fatalf("refusal allocated %d bytes", grew)
				}
				return
			}
			if err != nil || cmd || len(frames) != 3 {
				t.Fatalf("frames %d, cmd %v, err %v", len(frames), cmd, err)
			}
			if string(frames[0]) != "topic" || !bytes.Equal(frames[1], seqFrame(7)) || len(frames[2]) != 300 {
				t.Fatalf("frames %q %x %d bytes", frames[0], frames[1], len(frames[2]))
			}
			if _, _, err := r.next(); err != io.EOF {
				t.Fatalf("after the last message: %v, want io.EOF", err)
			}
		})
	}
}

// A message larger than zmtpKeepMessage is not held after the next one.
func TestZMTPReaderReleasesLargeBuffer(t *testing.T) {
	big := make([]byte, 2*zmtpKeepMessage)
	stream := append(zmtpFrames(big), zmtpFrames([]byte("small"))...)
	r := newZMTPReader(bytes.NewReader(stream), zmtpLimits{maxMessage: 4 * zmtpKeepMessage, maxFrames: 4})
	if f, _, err := r.next(); err != nil || len(f[0]) != len(big) {
		t.Fatalf("big message: %v", err)
	}
	if f, _, err := r.next(); err != nil || string(f[0]) != "small" {
		t.Fatalf("small message: %q %v", f, err)
	}
	if cap(r.buf) > zmtpKeepMessage {
		t.Fatalf("buffer of %d bytes kept", cap(r.buf))
	}
}

// PING is answered with a PONG carrying its context, and a malformed
// command ends the connection as bad framing.
func TestZMTPPeerPingAndBadCommand(t *testing.T) {
	ping := []byte{zmtpFlagCommand, 1 + 4 + 2 + 3, 4, 'P', 'I', 'N', 'G', 0, 10, 'c', 't', 'x'}
	stream := append(zmtpGreeting(), zmtpReady("PUB")...)
	stream = append(stream, ping...)
	stream = append(stream, zmtpFrames(nil, seqFrame(1), []byte{0x90})...)
	stream = append(stream, zmtpFlagCommand, 2, 9, 'X')
	c := &recConn{memConn: memConn{bytes.NewReader(stream)}}
	p, err := openZMTP(c, zmq4.Sub, zmtpLimits{maxMessage: 4096, maxFrames: 4})
	if err != nil {
		t.Fatal(err)
	}
	c.w.Reset() // the greeting and READY
	frames, err := p.recv()
	if err != nil || len(frames) != 3 {
		t.Fatalf("recv: %d frames, %v", len(frames), err)
	}
	pong := []byte{zmtpFlagCommand, 1 + 4 + 3, 4, 'P', 'O', 'N', 'G', 'c', 't', 'x'}
	if !bytes.Equal(c.w.Bytes(), pong) {
		t.Fatalf("wrote %x, want PONG %x", c.w.Bytes(), pong)
	}
	if _, err := p.recv(); !errors.Is(err, ErrBadFraming) {
		t.Fatalf("malformed command: %v, want ErrBadFraming", err)
	}
}

// Steady-state reading allocates nothing.
func TestZMTPReaderReusesBuffers(t *testing.T) {
	msg := zmtpFrames([]byte("t"), seqFrame(1), make([]byte, 1000))
	var stream []byte
	for i := 0; i < 200; i++ {
		stream = append(stream, msg...)
	}
	r := newZMTPReader(bytes.NewReader(stream), zmtpLimits{maxMessage: 4096, maxFrames: 4})
	if _, _, err := r.next(); err != nil {
		t.Fatal(err)
	}
	allocs := testing.AllocsPerRun(100, func() {
		if _, _, err := r.next(); err != nil {
			t.Fatal(err)
		}
	})
	if allocs != 0 {
		t.Fatalf("%v allocations per message", allocs)
	}
}
