package kvevents

import (
	"context"
	"crypto/rand"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"strconv"
	"sync"
	"time"
)

// The drain relay: with several gateway nodes, one node drains a
// TensorRT-LLM endpoint (see ownership.go) and re-serves what it drained
// to the others over HTTP, so every node's inventory follows the engine
// while the engine sees a single consumer of its destructive
// /kv_cache_events.
//
// What is relayed is each drain body the owner accepted (it decoded and
// held at least one event), byte for byte: followers apply it through the
// same decoder, limits, chain maps and parity attestation as the owner,
// so a follower that becomes the owner continues with warm chains (no
// "unknown parent" skips at the handover) and every node attests the
// engine's hashes itself.
//
// The stream is one long GET response of frames:
//
//	magic "KVR1" | seq uint64 BE | length uint32 BE | payload (length bytes)
//
// seq counts the frames of one relay epoch from 1 (the epoch, named in
// the X-Loxilb-Relay-Epoch header, is new each time the node becomes the
// owner); a frame with seq 0 and no payload is a heartbeat, sent when the
// stream is idle so a follower can tell a silent owner from a dead one. A
// follower reconnects with ?after=<last seq>&epoch=<epoch> and gets the
// frames it missed while they are still in the owner's bounded buffer;
// what is gone shows as a seq gap (counted), and the engine's event ids
// inside the bodies then tell the follower's applier what was lost, as
// they do for a drain.

// relayMagic starts every frame.
const relayMagic = "KVR1"

const relayHeaderLen = 4 + 8 + 4

// RelayEpochHeader names the owner's relay epoch on a stream response.
const RelayEpochHeader = "X-Loxilb-Relay-Epoch"

// NodeHeader names the gateway node on its drain requests, so an engine's
// access log (and the testbed emulator) can tell its consumers apart.
const NodeHeader = "X-Loxilb-Node"

// Defaults of the relay buffer and timing.
const (
	DefaultRelayBufferFrames = 1024
	DefaultRelayBufferBytes  = 64 << 20
	DefaultRelayHeartbeat    = time.Second
)

// ErrRelay wraps every reason a relay stream is dropped by its reader.
var ErrRelay = errors.New("kv relay stream")

// Relay error reasons (label reason of loxilb_kv_trtllm_relay_errors_total).
const (
	relayErrConnect   = "connect"
	relayErrStatus    = "bad_status"
	relayErrMagic     = "bad_magic"
	relayErrTooLarge  = "frame_too_large"
	relayErrTruncated = "truncated"
	relayErrIdle      = "idle_timeout"
	relayErrGap       = "seq_gap"
)

var allRelayErrors = []string{relayErrConnect, relayErrStatus, relayErrMagic, relayErrTooLarge, relayErrTruncated, relayErrIdle, relayErrGap}

// relayError is a stream failure with its metric reason.
type relayError struct {
	reason string
	err    error
}

func (e *relayError) Error() string { return e.err.Error() }
func (e *relayError) Unwrap() error { return e.err }

func relayErrf(reason, format string, args ...any) error {
	return &relayError{reason: reason, err: fmt.Errorf("%w: %s", ErrRelay, fmt.Sprintf(format, args...))}
}

// relayReason is the metric reason of a stream error.
func relayReason(err error) string {
	var re *relayError
	if errors.As(err, &re) {
		return re.reason
	}
	return relayErrConnect
}

type relayFrame struct {
	seq  uint64
	body []byte
}

// relayHub buffers the bodies one endpoint's owner drained, for the
// followers' streams. Safe for concurrent use.
type relayHub struct {
	maxFrames, maxBytes int

	mu      sync.Mutex
	owning  bool
	epoch   string
	frames  []relayFrame // oldest first, seqs consecutive
	bytes   int
	next    uint64
	changed chan struct{} // closed and replaced on every publish or ownership change
	streams int
}

func newRelayHub(maxFrames, maxBytes int) *relayHub {
	return &relayHub{maxFrames: maxFrames, maxBytes: maxBytes, next: 1, changed: make(chan struct{})}
}

func (h *relayHub) wakeLocked() {
	close(h.changed)
	h.changed = make(chan struct{})
}

// setOwning starts a new epoch when the node becomes the owner. When it
// stops being one, open streams still send what was published before
// (the last drain may have completed after the loss) and then end.
func (h *relayHub) setOwning(on bool) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if on == h.owning {
		return
	}
	h.owning = on
	if on {
		var b [8]byte
		_, _ = rand.Read(b[:])
		h.epoch = hex.EncodeToString(b[:])
		h.frames, h.bytes, h.next = nil, 0, 1
	}
	h.wakeLocked()
}

// publish appends one body (kept, not copied: the caller hands it over),
// dropping the oldest frames beyond the buffer's bounds. False when the
// node does not own the endpoint (nothing is kept).
func (h *relayHub) publish(body []byte) bool {
	h.mu.Lock()
	defer h.mu.Unlock()
	if !h.owning {
		return false
	}
	h.frames = append(h.frames, relayFrame{seq: h.next, body: body})
	h.next++
	h.bytes += len(body)
	drop := 0
	for len(h.frames)-drop > 1 && (len(h.frames)-drop > h.maxFrames || h.bytes > h.maxBytes) {
		h.bytes -= len(h.frames[drop].body)
		drop++
	}
	if drop > 0 {
		h.frames = append(h.frames[:0:0], h.frames[drop:]...)
	}
	h.wakeLocked()
	return true
}

// since returns the frames after seq `after` (from the oldest kept when
// older ones are gone), a channel closed at the next change, and false
// when the stream is over: the epoch is not the current one, or the node
// no longer owns the endpoint and the stream has sent everything.
func (h *relayHub) since(after uint64, epoch string) ([]relayFrame, <-chan struct{}, bool) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.epoch != epoch {
		return nil, nil, false
	}
	i := 0
	if len(h.frames) > 0 && after >= h.frames[0].seq {
		i = int(min(after-h.frames[0].seq+1, uint64(len(h.frames))))
	}
	rest := h.frames[i:len(h.frames):len(h.frames)]
	return rest, h.changed, h.owning || len(rest) > 0
}

// open registers a stream and returns the epoch it reads, false when the
// node does not own the endpoint.
func (h *relayHub) open() (string, bool) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if !h.owning {
		return "", false
	}
	h.streams++
	return h.epoch, true
}

func (h *relayHub) close() {
	h.mu.Lock()
	h.streams--
	h.mu.Unlock()
}

func (h *relayHub) followers() int {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.streams
}

func appendFrameHeader(b []byte, seq uint64, n int) []byte {
	b = append(b, relayMagic...)
	b = binary.BigEndian.AppendUint64(b, seq)
	return binary.BigEndian.AppendUint32(b, uint32(n))
}

// ServeRelay is the HTTP handler of the relay stream (mounted by the API
// server): GET ?endpoint=host:port[&after=seq&epoch=e] streams the bodies
// this node drains from that TensorRT-LLM endpoint. 404 when no rule
// drains it here, 409 when another node owns it.
func (m *Manager) ServeRelay(w http.ResponseWriter, r *http.Request) {
	q := r.URL.Query()
	ep := q.Get("endpoint")
	s := m.trtSubscription(ep)
	if s == nil {
		http.Error(w, fmt.Sprintf("no TensorRT-LLM subscription for endpoint %q on this node", ep), http.StatusNotFound)
		return
	}
	after, err := strconv.ParseUint(q.Get("after"), 10, 64)
	if q.Get("after") != "" && err != nil {
		http.Error(w, "after: want a frame sequence number", http.StatusBadRequest)
		return
	}
	epoch, ok := s.hub.open()
	if !ok {
		http.Error(w, fmt.Sprintf("this node does not drain %s: follow the owner named in the inventory", ep), http.StatusConflict)
		return
	}
	defer s.hub.close()
	if q.Get("epoch") != epoch {
		after = 0
	}
	rc := http.NewResponseController(w)
	w.Header().Set("Content-Type", "application/x-loxilb-kv-relay")
	w.Header().Set(RelayEpochHeader, epoch)
	w.WriteHeader(http.StatusOK)
	hb := m.cfg.RelayHeartbeat
	write := func(b []byte) bool {
		// A follower that stops reading is dropped after a few
		// heartbeats; the API server's write timeout would otherwise
		// end every stream.
		_ = rc.SetWriteDeadline(time.Now().Add(4 * hb))
		_, err := w.Write(b)
		return err == nil && rc.Flush() == nil
	}
	if !write(appendFrameHeader(nil, 0, 0)) {
		return
	}
	t := time.NewTimer(hb)
	defer t.Stop()
	var buf []byte
	for {
		frames, changed, ok := s.hub.since(after, epoch)
		if !ok {
			return
		}
		for _, f := range frames {
			buf = append(appendFrameHeader(buf[:0], f.seq, len(f.body)), f.body...)
			if !write(buf) {
				return
			}
			after = f.seq
		}
		t.Reset(hb)
		select {
		case <-changed:
		case <-t.C:
			if !write(appendFrameHeader(buf[:0], 0, 0)) {
				return
			}
		case <-r.Context().Done():
			return
		}
	}
}

// trtSubscription returns the TensorRT-LLM subscription draining host:port.
func (m *Manager) trtSubscription(hp string) *subscription {
	m.mu.Lock()
	defer m.mu.Unlock()
	for _, s := range m.subs {
		if s.spec.Engine == EngineTRTLLM && hostPort(s.spec.Host, s.spec.TargetPort) == hp {
			return s
		}
	}
	return nil
}

// relayCursor is where a follower is in the owner's stream.
type relayCursor struct {
	epoch string
	after uint64
}

// relayReader reads one owner's relay stream for one endpoint.
type relayReader struct {
	cl       *http.Client
	token    string // bearer token of the owner's API, "" for none
	base     string // the owner's stream URL
	endpoint string // host:port of the engine
	maxBody  int64  // largest payload accepted, as for a drain body
	idle     time.Duration
	onOpen   func()
	apply    func([]byte) // the payload is only valid during the call
	gap      func(uint64)
}

// read connects to the owner's stream and hands every payload to apply
// until the stream fails or ctx ends. The announced frame length is
// checked against maxBody before anything is allocated; a stream silent
// for idle (no frame, no heartbeat) is dropped.
func (r *relayReader) read(ctx context.Context, cur *relayCursor) error {
	base := r.base
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	u := base + "?" + url.Values{"endpoint": {r.endpoint}, "after": {strconv.FormatUint(cur.after, 10)}, "epoch": {cur.epoch}}.Encode()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, u, http.NoBody)
	if err != nil {
		return relayErrf(relayErrConnect, "%s: %v", base, err)
	}
	if r.token != "" {
		req.Header.Set("Authorization", "Bearer "+r.token)
	}
	resp, err := r.cl.Do(req)
	if err != nil {
		return relayErrf(relayErrConnect, "%v", err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		msg, _ := io.ReadAll(io.LimitReader(resp.Body, 512))
		return relayErrf(relayErrStatus, "%s: HTTP %d: %s", base, resp.StatusCode, msg)
	}
	epoch := resp.Header.Get(RelayEpochHeader)
	if epoch != cur.epoch {
		*cur = relayCursor{epoch: epoch}
	}
	r.onOpen()
	idle := r.idle
	// The idle timer cancels the request: a read blocked on a silent
	// owner then returns.
	var idled bool
	var mu sync.Mutex
	t := time.AfterFunc(idle, func() { mu.Lock(); idled = true; mu.Unlock(); cancel() })
	defer t.Stop()
	hdr := make([]byte, relayHeaderLen)
	var body []byte
	for {
		if _, err := io.ReadFull(resp.Body, hdr); err != nil {
			return relayReadErr(ctx, &mu, &idled, idle, "frame header", err)
		}
		t.Reset(idle)
		if string(hdr[:4]) != relayMagic {
			return relayErrf(relayErrMagic, "%s: frame starts with %q, want %q", base, hdr[:4], relayMagic)
		}
		seq := binary.BigEndian.Uint64(hdr[4:12])
		n := binary.BigEndian.Uint32(hdr[12:16])
		if int64(n) > r.maxBody {
			return relayErrf(relayErrTooLarge, "%s: frame %d announces %d bytes, limit %d", base, seq, n, r.maxBody)
		}
		if seq == 0 {
			if n != 0 {
				return relayErrf(relayErrMagic, "%s: heartbeat frame with a %d-byte payload", base, n)
			}
			continue
		}
		if cap(body) < int(n) {
			body = make([]byte, n)
		}
		body = body[:n]
		if _, err := io.ReadFull(resp.Body, body); err != nil {
			return relayReadErr(ctx, &mu, &idled, idle, fmt.Sprintf("frame %d payload (%d bytes)", seq, n), err)
		}
		t.Reset(idle)
		if seq <= cur.after {
			return relayErrf(relayErrGap, "%s: frame %d after %d in one epoch", base, seq, cur.after)
		}
		if seq > cur.after+1 {
			r.gap(seq - cur.after - 1)
		}
		cur.after = seq
		r.apply(body)
	}
}

func relayReadErr(ctx context.Context, mu *sync.Mutex, idled *bool, idle time.Duration, what string, err error) error {
	mu.Lock()
	wasIdle := *idled
	mu.Unlock()
	switch {
	case wasIdle:
		return relayErrf(relayErrIdle, "no frame for %v", idle)
	case ctx.Err() != nil:
		return ctx.Err()
	case errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, io.EOF):
		return relayErrf(relayErrTruncated, "stream ended inside or before %s", what)
	}
	return relayErrf(relayErrConnect, "read %s: %v", what, err)
}
