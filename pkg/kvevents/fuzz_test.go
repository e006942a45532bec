package kvevents

import (
	"bytes"
	"net"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"
)

func FuzzDecodeBatch(f *testing.F) {
	for _, file := range []string{"vllm_event_vectors.json", "sglang_event_vectors.json"} {
		for _, v := range loadEventVectors(f, file) {
			_, _, p := v.frames(f)
			f.Add(p)
		}
	}
	f.Add([]byte{0x92, 0x00, 0x90})
	f.Add([]byte{0xdf, 0xff, 0xff, 0xff, 0xff})
	f.Fuzz(func(t *testing.T, p []byte) {
		var b Batch
		for _, order := range []KeyOrder{KeyLast8, KeyFirst8} {
			if err := NewDecoder(order).Decode(p, &b); err != nil {
				continue
			}
			for _, e := range b.Events {
				if len(e.Hashes) > len(p) || len(e.Tokens) > len(p) {
					t.Fatalf("decoded more items than payload bytes")
				}
			}
		}
	})
}

func FuzzMsgpackSkip(f *testing.F) {
	f.Add([]byte{0x93, 0x01, 0x92, 0xc0, 0xa1, 'x', 0x81, 0x01, 0x02})
	f.Fuzz(func(t *testing.T, p []byte) {
		var r mpReader
		r.reset(p)
		for r.remaining() > 0 {
			before := r.off
			if err := r.skip(); err != nil {
				return
			}
			if r.off <= before {
				t.Fatal("skip made no progress")
			}
		}
	})
}

func FuzzDecodeTRTLLMBody(f *testing.F) {
	f.Add(loadTRTBody(f))
	f.Add([]byte(`[{"event_id":1,"data":{"type":"stored","parent_hash":null,"blocks":[]}}]`))
	f.Add([]byte(`[{"event_id":2,"data":{"type":"removed","block_hashes":[18446744073709551615]}}]`))
	f.Fuzz(func(t *testing.T, body []byte) {
		evs, _, err := DecodeTRTLLMBody(body)
		if err != nil && len(evs) != 0 {
			t.Fatal("events returned with a body error")
		}
	})
}

func FuzzServerInfoGeometry(f *testing.F) {
	f.Add([]byte(`{"kv_cache_hash_algo":"v1_block_key","tokens_per_block":32}`))
	f.Add([]byte(`{"kv_cache_config":{"tokens_per_block":16}}`))
	f.Add([]byte(`{"disaggregated_params":{}}`))
	f.Fuzz(func(t *testing.T, body []byte) {
		algo, tpb, err := serverInfoGeometry(body)
		if err == nil && tpb == 0 {
			t.Fatalf("tokens_per_block 0 accepted (algo %q)", algo)
		}
	})
}

// memConn is a net.Conn reading from a fixed input and discarding writes.
type memConn struct{ r *bytes.Reader }

func (c memConn) Read(p []byte) (int, error)       { return c.r.Read(p) }
func (c memConn) Write(p []byte) (int, error)      { return len(p), nil }
func (c memConn) Close() error                     { return nil }
func (c memConn) LocalAddr() net.Addr              { return &net.TCPAddr{} }
func (c memConn) RemoteAddr() net.Addr             { return &net.TCPAddr{} }
func (c memConn) SetDeadline(time.Time) error      { return nil }
func (c memConn) SetReadDeadline(time.Time) error  { return nil }
func (c memConn) SetWriteDeadline(time.Time) error { return nil }

// FuzzZMTPPeer feeds arbitrary bytes from a peer through the handshake
// (zmq4 over the limited connection) and the frame reader, as the
// subscriber reads them: after a valid
// greeting (even first byte: and a valid READY, so data frames are
// fuzzed; odd: the READY itself is fuzzed). Nothing may panic, and no
// message may exceed the limits.
func FuzzZMTPPeer(f *testing.F) {
	f.Add([]byte{0, 0, 3, 'a', 'b', 'c'})
	f.Add(append([]byte{0}, longFrameHeader(0, 1<<62)...))
	f.Add(append([]byte{0, zmtpFlagMore, 1, 'x', zmtpFlagMore, 0}, longFrameHeader(0, 5000)...))
	f.Add(append([]byte{1}, zmtpReady("PUB")...))
	f.Add([]byte{1, zmtpFlagCommand, 8, 5, 'R', 'E', 'A', 'D', 'Y', 200, 'x'})
	f.Add([]byte{0, zmtpFlagCommand, 5, 4, 'P', 'I', 'N', 'G'})
	const maxMsg, maxFrames = 4096, 8
	f.Fuzz(func(t *testing.T, in []byte) {
		if len(in) == 0 {
			return
		}
		stream := zmtpGreeting()
		if in[0]%2 == 0 {
			stream = append(stream, zmtpReady("PUB")...)
		}
		stream = append(stream, in[1:]...)
		p, err := openZMTP(memConn{bytes.NewReader(stream)}, zmq4.Sub, zmtpLimits{maxMessage: maxMsg, maxFrames: maxFrames})
		if err != nil {
			return
		}
		for i := 0; i < len(in); i++ {
			frames, err := p.recv()
			if err != nil {
				return
			}
			total := 0
			for _, fr := range frames {
				total += len(fr)
			}
			if total > maxMsg || len(frames) > maxFrames {
				t.Fatalf("message of %d frames, %d bytes passed the limits", len(frames), total)
			}
		}
	})
}

// FuzzDecodeBatchLimits decodes under small caps: a decoded batch never
// holds more than the caps, whatever the payload announces.
func FuzzDecodeBatchLimits(f *testing.F) {
	f.Add(tinyEventsBatch(20))
	f.Add(batchStoredThenTokens(10))
	f.Add(storedBatch(1, 2, 3, 4, 5, 6, 7, 8, 9))
	lim := DecodeLimits{Events: 4, Hashes: 8, Tokens: 16}
	f.Fuzz(func(t *testing.T, p []byte) {
		var b Batch
		d := NewDecoder(KeyFirst8).WithLimits(lim)
		if err := d.Decode(p, &b); err != nil {
			return
		}
		hashes, tokens := 0, 0
		for _, e := range b.Events {
			hashes += len(e.Hashes)
			tokens += len(e.Tokens)
		}
		if len(b.Events) > lim.Events || hashes > lim.Hashes || tokens > lim.Tokens {
			t.Fatalf("batch of %d events, %d hashes, %d tokens passed caps %+v", len(b.Events), hashes, tokens, lim)
		}
		body, errs, _, err := DecodeTRTLLMBodyLimits(p, lim)
		if err == nil && (len(body) > lim.Events || len(errs) > maxTRTErrs) {
			t.Fatalf("drain of %d events, %d errors passed caps", len(body), len(errs))
		}
	})
}
