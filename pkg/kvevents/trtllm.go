package kvevents

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"time"

	"github.com/loxilb-llm/loxilb/pkg/blockhash"
)

// trtChain maps the engine's block handles to the gateway's keys and digests
// for one attention-DP rank. TensorRT-LLM publishes its own block hash (a
// different contract), so the gateway rehashes each stored block's tokens
// with the rule's algorithm, chaining from the parent's gateway digest.
type trtChain struct {
	m      map[uint64]trtEntry
	window int64 // first window_size seen; other windows are skipped
	hasID  bool
	lastID uint64
}

type trtEntry struct {
	key uint64
	d   blockhash.Digest
}

// trtState is what one endpoint's event stream builds up: the rule's
// hasher and the chains per attention-DP rank. It lives as long as the
// subscription, across drain/relay switches, and is used by one goroutine
// at a time.
type trtState struct {
	h      *blockhash.Hasher
	chains map[int]*trtChain
}

// runTRT reads the endpoint's events until ctx ends: by draining it
// (one node, or the elected owner) or from the owner's relay.
func (s *subscription) runTRT(ctx context.Context, rs *rankState) {
	h, err := newHasher(s.spec, s.spec.algo())
	if err != nil {
		s.mu.Lock()
		s.lastError = err.Error()
		s.mu.Unlock()
		s.m.log.Error("trtllm kv subscription cannot start", "service", s.spec.Service, "ep", s.spec.EPIdx, "err", err)
		return
	}
	st := &trtState{h: h, chains: make(map[int]*trtChain)}
	if s.m.cfg.Drain == nil {
		s.setDrain(DrainSingle, "")
		s.guard(ctx, rs, st, func(ctx context.Context) { s.drainLoop(ctx, rs, st) })
		return
	}
	s.runOwned(ctx, rs, st)
}

// guard runs f until ctx ends. A panic is recovered and counted (no engine
// response or relay frame can take the process down), the endpoint's
// blocks are cleared, and f starts over with fresh chains after a growing
// pause.
func (s *subscription) guard(ctx context.Context, rs *rankState, st *trtState, f func(context.Context)) {
	backoff := s.m.cfg.ReconnectMin
	for ctx.Err() == nil {
		if !s.guardOnce(ctx, rs, f) {
			return
		}
		st.chains = make(map[int]*trtChain)
		if !sleepCtx(ctx, backoff) {
			return
		}
		backoff = min(2*backoff, s.m.cfg.ReconnectMax)
	}
}

// guardOnce is f until it returns (false) or panics (true).
func (s *subscription) guardOnce(ctx context.Context, rs *rankState, f func(context.Context)) (panicked bool) {
	defer func() {
		if v := recover(); v != nil {
			s.recovered(rs, 0, v)
			// And the attention-DP ranks named in the events: this
			// stream is the endpoint's only writer.
			s.m.sink.ClearEndpoint(s.spec.Service, s.spec.EPIdx)
			s.setConnected(rs, false, false)
			panicked = true
		}
	}()
	f(ctx)
	return false
}

// drainLoop admits the endpoint, then drains POST /kv_cache_events with an
// adaptive interval until ctx ends, publishing each accepted body to the
// relay (which keeps it only while this node owns the endpoint). A failing
// drain sends it back through admission: the engine may have been
// relaunched with other geometry.
func (s *subscription) drainLoop(ctx context.Context, rs *rankState, st *trtState) {
	everConnected := false
	cfg := &s.m.cfg
	for ctx.Err() == nil {
		if !s.admitTRT(ctx) {
			return
		}
		interval := cfg.TRTPollMin
		backoff := cfg.ReconnectMin
		for ctx.Err() == nil {
			body, err := s.drainTRT(ctx, rs)
			if err != nil {
				if ctx.Err() != nil {
					return
				}
				if errors.Is(err, ErrInputTooLarge) {
					s.reject(rs, rejectBodyTooLarge, err)
					s.setDegraded(rs, "a drain body over the size limit was refused: "+err.Error())
				} else {
					s.recvError(rs, err)
				}
				s.setConnected(rs, false, false)
				if !sleepCtx(ctx, backoff) {
					return
				}
				backoff = min(2*backoff, cfg.ReconnectMax)
				if backoff >= cfg.ReconnectMax {
					break // re-check admission
				}
				continue
			}
			backoff = cfg.ReconnectMin
			if !rs.st.Connected {
				s.setConnected(rs, true, everConnected)
				everConnected = true
			}
			n := s.applyTRTBody(rs, st.h, st.chains, body)
			if n > 0 {
				if s.hub.publish(body) {
					s.met.relaySent.Inc()
					s.mu.Lock()
					s.st.Drain.RelayFrames++
					s.mu.Unlock()
				}
				interval = cfg.TRTPollMin
			} else {
				interval = min(interval*3/2, cfg.TRTPollMax)
			}
			if !sleepCtx(ctx, interval) {
				return
			}
		}
	}
}

// drainGrace is how long a drain already sent may still complete after
// its context ends (the node lost the endpoint's ownership, or the rule
// changed): the engine gives the events away when it answers, so an
// answer cut off unread loses them for every node.
const drainGrace = time.Second

// drainTRT performs one destructive drain.
func (s *subscription) drainTRT(ctx context.Context, rs *rankState) ([]byte, error) {
	cfg := &s.m.cfg
	rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), cfg.TRTHTTPTimeout)
	defer cancel()
	stop := context.AfterFunc(ctx, func() { time.AfterFunc(drainGrace, cancel) })
	defer stop()
	req, err := http.NewRequestWithContext(rctx, http.MethodPost, rs.st.Endpoint, http.NoBody)
	if err != nil {
		return nil, fmt.Errorf("build drain request: %w", err)
	}
	req.Header.Set("Accept", "application/json")
	if cfg.NodeName != "" {
		req.Header.Set(NodeHeader, cfg.NodeName)
	}
	resp, err := cfg.HTTPClient.Do(req)
	if err != nil {
		return nil, fmt.Errorf("drain %s: %w", rs.st.Endpoint, err)
	}
	defer resp.Body.Close()
	if resp.StatusCode == http.StatusOK && resp.ContentLength > cfg.TRTMaxBody {
		// Announced too large: refused without reading it.
		return nil, fmt.Errorf("drain %s: %w: body of %d bytes announced, limit %d", rs.st.Endpoint, ErrInputTooLarge, resp.ContentLength, cfg.TRTMaxBody)
	}
	body, err := io.ReadAll(io.LimitReader(resp.Body, cfg.TRTMaxBody+1))
	if err != nil {
		return nil, fmt.Errorf("drain %s: read body: %w", rs.st.Endpoint, err)
	}
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("drain %s: HTTP %d", rs.st.Endpoint, resp.StatusCode)
	}
	if int64(len(body)) > cfg.TRTMaxBody {
		// The events are gone from the engine either way; say so.
		return nil, fmt.Errorf("drain %s: %w: body larger than %d bytes dropped", rs.st.Endpoint, ErrInputTooLarge, cfg.TRTMaxBody)
	}
	return body, nil
}

// applyTRTBody decodes and applies one drain and returns the number of
// events it held.
func (s *subscription) applyTRTBody(rs *rankState, h *blockhash.Hasher, chains map[int]*trtChain, body []byte) int {
	events, errs, bad, err := DecodeTRTLLMBodyLimits(body, s.m.cfg.decodeLimits())
	if err != nil {
		if errors.Is(err, ErrBatchLimit) {
			// The drain took the events from the engine: they are lost.
			s.reject(rs, rejectBatchLimit, err)
			s.setDegraded(rs, "a drain over the batch limits was refused: "+err.Error())
			return 0
		}
		s.decodeError(rs, err)
		return 0
	}
	for _, e := range errs {
		s.decodeError(rs, e)
	}
	if more := bad - len(errs); more > 0 {
		s.countDecodeErrors(rs, uint64(more))
	}
	var c applyCounts
	var keys []uint64
	var lastID uint64
	for i := range events {
		ev := &events[i]
		rank := max(ev.Rank, 0)
		if rank >= MaxRanks {
			// The inventory holds MaxRanks ranks per endpoint, and each
			// rank keeps a chain map: an engine naming any rank must not
			// make the gateway keep thousands of them.
			c.skip(skipRank, 1)
			continue
		}
		ch := chains[rank]
		if ch == nil {
			ch = &trtChain{m: make(map[uint64]trtEntry)}
			chains[rank] = ch
		}
		lastID = ev.EventID
		if ch.hasID {
			switch {
			case ev.EventID == ch.lastID:
				c.skip(skipDuplicate, 1)
				continue
			case ev.EventID < ch.lastID:
				s.reset(rs, rank, resetSeqBackwards)
				ch.reset()
			case ev.EventID > ch.lastID+1:
				// Nothing can replay a drained event: another reader of
				// /kv_cache_events took them, or the engine dropped them.
				s.countGap(rs)
				missing := ev.EventID - ch.lastID - 1
				s.setDegraded(rs, fmt.Sprintf("event ids %d..%d missing: another consumer may be draining /kv_cache_events",
					ch.lastID+1, ev.EventID-1))
				if missing > s.m.cfg.GapKeepWindow {
					s.reset(rs, rank, resetGap)
					ch.reset()
				}
			}
		}
		ch.hasID, ch.lastID = true, ev.EventID
		switch ev.Kind {
		case TRTCreated:
			s.reset(rs, rank, resetCreated)
			ch.reset()
			ch.hasID, ch.lastID = true, ev.EventID
			c.events[KindCleared]++
		case TRTStored:
			if ch.window == 0 {
				ch.window = ev.WindowSize
			} else if ev.WindowSize != 0 && ev.WindowSize != ch.window {
				c.skip(skipWindow, 1)
				continue
			}
			var parent blockhash.Digest
			if ev.HasParent {
				pe, ok := ch.m[ev.ParentHash]
				if !ok {
					c.skip(skipUnknownParent, 1)
					continue
				}
				parent = pe.d
			}
			keys = keys[:0]
			for _, b := range ev.Blocks {
				if !b.Plain {
					c.skip(skipNonPlain, 1)
					break
				}
				if len(b.Tokens) != s.spec.BlockSize {
					s.parity.observeTRT(false, len(b.Tokens))
					c.skip(skipBlockSize, 1)
					break
				}
				d, k := h.Next(parent, b.Tokens)
				if len(ch.m) >= s.m.cfg.TRTMaxChain {
					ch.m = make(map[uint64]trtEntry)
					s.met.resets[resetChainFull].Inc()
				}
				ch.m[b.Hash] = trtEntry{key: k, d: d}
				keys = append(keys, k)
				parent = d
				s.parity.observeTRT(true, len(b.Tokens))
			}
			if len(keys) > 0 {
				s.m.sink.Store(s.spec.Service, s.spec.EPIdx, rank, keys)
				c.stored += uint64(len(keys))
				c.events[KindStored]++
			}
		case TRTRemoved:
			keys = keys[:0]
			for _, hh := range ev.Removed {
				e, ok := ch.m[hh]
				if !ok {
					c.skip(skipUnknownHandle, 1)
					continue
				}
				delete(ch.m, hh)
				keys = append(keys, e.key)
			}
			if len(keys) > 0 {
				s.m.sink.Remove(s.spec.Service, s.spec.EPIdx, rank, keys)
				c.removed += uint64(len(keys))
			}
			c.events[KindRemoved]++
		case TRTUpdated:
			// Priority and cache-level changes do not change residency.
		default:
			c.events[KindUnknown]++
			c.skip(skipUnknownType, 1)
		}
	}
	s.flushCounts(rs, &c, lastID, len(events) > 0)
	return len(events)
}

func (ch *trtChain) reset() {
	ch.m = make(map[uint64]trtEntry)
	ch.window = 0
	ch.hasID = false
}

// admitTRT checks the endpoint's /server_info geometry until it is admitted
// (true) or ctx ends (false). Engines whose /server_info exposes
// kv_cache_hash_algo or tokens_per_block are refused when they contradict
// the rule; engines that expose neither (the released versions) are admitted
// with a warning, on the rule's word.
func (s *subscription) admitTRT(ctx context.Context) bool {
	cfg := &s.m.cfg
	for {
		a := s.checkServerInfo(ctx)
		s.mu.Lock()
		prev := s.st.Admission.Verdict
		s.st.Admission = &a
		s.mu.Unlock()
		s.met.setAdmission(a.Verdict)
		l := s.m.log.With("service", s.spec.Service, "ep", s.spec.EPIdx, "verdict", a.Verdict, "reason", a.Reason)
		if prev != a.Verdict {
			switch a.Verdict {
			case AdmissionRefused:
				l.Error("trtllm endpoint refused: engine geometry contradicts the rule; no KV events are consumed")
			case AdmissionLegacy:
				l.Warn("trtllm endpoint admitted without geometry check: /server_info does not expose it")
			case AdmissionAdmitted:
				l.Info("trtllm endpoint admitted")
			}
		}
		wait := cfg.TRTAdmissionRetry
		switch a.Verdict {
		case AdmissionAdmitted, AdmissionLegacy:
			return true
		case AdmissionRefused:
			wait = cfg.TRTAdmissionRecheck
		}
		if !sleepCtx(ctx, wait) {
			return false
		}
	}
}

func (s *subscription) checkServerInfo(ctx context.Context) Admission {
	cfg := &s.m.cfg
	a := Admission{Verdict: AdmissionPending, CheckedAt: time.Now()}
	url := "http://" + hostPort(s.spec.Host, s.spec.TargetPort) + "/server_info"
	rctx, cancel := context.WithTimeout(ctx, cfg.TRTHTTPTimeout)
	defer cancel()
	req, err := http.NewRequestWithContext(rctx, http.MethodGet, url, http.NoBody)
	if err != nil {
		a.Reason = err.Error()
		return a
	}
	resp, err := cfg.HTTPClient.Do(req)
	if err != nil {
		a.Reason = fmt.Sprintf("GET %s: %v", url, err)
		return a
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
	if err != nil {
		a.Reason = fmt.Sprintf("GET %s: %v", url, err)
		return a
	}
	switch {
	case resp.StatusCode == http.StatusNotFound:
		a.Verdict, a.Reason = AdmissionLegacy, "/server_info not served"
		return a
	case resp.StatusCode != http.StatusOK:
		a.Reason = fmt.Sprintf("GET %s: HTTP %d", url, resp.StatusCode)
		return a
	}
	algo, tpb, err := serverInfoGeometry(body)
	if err != nil {
		a.Verdict, a.Reason = AdmissionLegacy, fmt.Sprintf("/server_info unreadable (%v)", err)
		return a
	}
	switch {
	case algo == "" && tpb < 0:
		a.Verdict, a.Reason = AdmissionLegacy, "/server_info has no kv_cache_hash_algo or tokens_per_block"
	case algo != "" && algo != "v1_block_key":
		a.Verdict, a.Reason = AdmissionRefused, fmt.Sprintf("engine kv_cache_hash_algo is %q, the gateway contract needs v1_block_key", algo)
	case tpb >= 0 && tpb != int64(s.spec.BlockSize):
		a.Verdict, a.Reason = AdmissionRefused, fmt.Sprintf("engine tokens_per_block is %d but the rule's kvBlockSize is %d", tpb, s.spec.BlockSize)
	default:
		a.Verdict, a.Reason = AdmissionAdmitted, "engine geometry matches the rule"
	}
	return a
}

// serverInfoGeometry finds kv_cache_hash_algo and tokens_per_block at the top
// level of /server_info or one object below it (kv_cache_config and the
// like). tpb is -1 when absent.
func serverInfoGeometry(body []byte) (algo string, tpb int64, err error) {
	dec := json.NewDecoder(bytes.NewReader(body))
	dec.UseNumber()
	var top map[string]any
	if err := dec.Decode(&top); err != nil {
		return "", -1, err
	}
	tpb = -1
	look := func(m map[string]any) error {
		if v, ok := m["kv_cache_hash_algo"].(string); ok && algo == "" {
			algo = v
		}
		if v, ok := m["tokens_per_block"]; ok && tpb < 0 && v != nil {
			n, ok := v.(json.Number)
			if !ok {
				return errors.New("tokens_per_block is not a number")
			}
			x, err := strconv.ParseInt(string(n), 10, 64)
			if err != nil || x < 1 {
				return fmt.Errorf("tokens_per_block %q invalid", string(n))
			}
			tpb = x
		}
		return nil
	}
	if err := look(top); err != nil {
		return "", -1, err
	}
	for _, v := range top {
		if m, ok := v.(map[string]any); ok {
			if err := look(m); err != nil {
				return "", -1, err
			}
		}
	}
	return algo, tpb, nil
}
