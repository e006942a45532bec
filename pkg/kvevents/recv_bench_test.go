package kvevents

import (
	"context"
	"encoding/binary"
	"net"
	"testing"

	"github.com/go-zeromq/zmq4"
	"github.com/go-zeromq/zmq4/security/null"
)

// zmtpFrames encodes one message as ZMTP 3 data frames, as a publisher
// puts it on the wire.
func zmtpFrames(frames ...[]byte) []byte {
	var out []byte
	for i, f := range frames {
		fl := byte(0)
		if i < len(frames)-1 {
			fl |= zmtpFlagMore
		}
		if len(f) > 255 {
			out = append(out, fl|zmtpFlagLong)
			out = binary.BigEndian.AppendUint64(out, uint64(len(f)))
		} else {
			out = append(out, fl, byte(len(f)))
		}
		out = append(out, f...)
	}
	return out
}

// benchPub accepts one SUB on loopback, completes the ZMTP handshake with
// zmq4's own NULL mechanism, then writes msgs (pre-encoded messages, perBlock
// of them) until n messages are out, over the raw connection: the reader's
// cost is measured, not a publisher's. With paced set, each write waits
// for a receive on paced (the reader has applied the previous one).
func benchPub(b *testing.B, msgs []byte, perBlock, n int, paced chan struct{}) string {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { ln.Close() })
	go func() {
		c, err := ln.Accept()
		if err != nil {
			return
		}
		defer c.Close()
		if _, err := zmq4.Open(c, null.Security(), zmq4.Pub, zmq4.SocketIdentity(""), true, nil); err != nil {
			return
		}
		for sent := 0; sent < n; sent += perBlock {
			if paced != nil && sent > 0 {
				<-paced
			}
			if _, err := c.Write(msgs); err != nil {
				return
			}
		}
		// Hold the connection until the reader is done.
		var one [1]byte
		_, _ = c.Read(one[:])
	}()
	return "tcp://" + ln.Addr().String()
}

// benchRecvApply measures the live path of one publisher per message:
// socket reads, framing and limit checks, seq checks, decoding and
// applying. Messages are written back to back, as in an event burst.
func benchRecvApply(b *testing.B, nEvents, blocksPer int, paced bool) {
	payload, _ := benchPayload(b, nEvents, blocksPer)
	perBlock := 64
	var pace chan struct{}
	if paced {
		perBlock, pace = 1, make(chan struct{}, 1)
	}
	var msgs []byte
	for i := 0; i < perBlock; i++ {
		msgs = append(msgs, zmtpFrames(nil, seqFrame(0), payload)...)
	}
	n := (b.N + perBlock - 1) / perBlock * perBlock
	ep := benchPub(b, msgs, perBlock, n, pace)
	m := New(Config{}, nopSink{}, nil, nil)
	spec := Spec{Service: 1, Engine: EngineVLLM, Host: "127.0.0.1", ZmqPort: 5557, BlockSize: 16, HashAlgo: "sha256_cbor", Seed: "42"}
	s := newSubscription(m, spec)
	z := &zmqRank{s: s, rs: s.ranks[0], dec: NewDecoder(KeyLast8)}
	peer, err := dialZMTP(context.Background(), ep, zmq4.Sub, &m.cfg)
	if err != nil {
		b.Fatal(err)
	}
	defer peer.close()
	b.SetBytes(int64(len(msgs) / perBlock))
	b.ReportAllocs()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		frames, err := peer.recv()
		if err != nil {
			b.Fatal(err)
		}
		if len(frames) != 3 {
			b.Fatalf("%d frames", len(frames))
		}
		// Every message carries seq 0: apply it directly so the seq
		// checks do not treat the stream as restarts.
		z.apply(uint64(i), frames[2])
		if pace != nil {
			pace <- struct{}{}
		}
	}
	b.StopTimer()
	if st := s.status(); st.DecodeErrors != 0 {
		b.Fatalf("decode errors: %+v", st)
	}
}

// BenchmarkRecvApplySmall is a burst of small batches (one stored run of 8
// blocks and its removal each), back to back on the socket.
func BenchmarkRecvApplySmall(b *testing.B) { benchRecvApply(b, 1, 8, false) }

// BenchmarkRecvApplyLarge is a burst of BenchmarkDecodeApply's batch.
func BenchmarkRecvApplyLarge(b *testing.B) { benchRecvApply(b, 32, 4, false) }

// BenchmarkRecvApplyPaced is one small batch at a time, the next written
// only once the previous is applied, as an engine publishes one batch per
// request: every message costs the reader a wakeup. ns/op includes the
// writer's side and both goroutines' hand-offs.
func BenchmarkRecvApplyPaced(b *testing.B) { benchRecvApply(b, 1, 8, true) }
