package kvevents

import (
	"cmp"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"slices"
	"strconv"

	"github.com/go-zeromq/zmq4"
	"github.com/zeebo/xxh3"
)

func hostPort(host string, port int) string { return net.JoinHostPort(host, strconv.Itoa(port)) }

// zmqRank is the per-goroutine state of one ZMQ publisher: the decoder and
// batch buffers it reuses.
type zmqRank struct {
	s   *subscription
	rs  *rankState
	dec *Decoder
	b   Batch
	c   applyCounts
}

// runZMQ subscribes to one publisher until ctx ends: dial with backoff,
// replay what the engine buffered, then apply live batches in seq order. A
// connection that ends in refused input or a panic is redialled with the
// same growing backoff as a failed dial, so a hostile peer costs one
// attempt per ReconnectMax at most.
func (s *subscription) runZMQ(ctx context.Context, rs *rankState) {
	order := KeyLast8
	if s.spec.Engine == EngineSGLang {
		order = KeyFirst8
	}
	z := &zmqRank{s: s, rs: rs, dec: s.newDecoder(order)}
	cfg := &s.m.cfg
	backoff := cfg.ReconnectMin
	everConnected := false
	for ctx.Err() == nil {
		connected, healthy := z.session(ctx, everConnected)
		everConnected = everConnected || connected
		wait := cfg.ReconnectMin
		if connected && healthy {
			backoff = cfg.ReconnectMin
		} else {
			wait = backoff
			backoff = min(2*backoff, cfg.ReconnectMax)
		}
		if !sleepCtx(ctx, wait) {
			return
		}
	}
}

// session runs one connection to the publisher: dial, replay, then live
// batches until the connection fails. healthy is false when it ended in
// refused input or a panic. A panic anywhere in the connection (framing,
// decoding, applying) is recovered here: no peer can take the process
// down.
func (z *zmqRank) session(ctx context.Context, reconnect bool) (connected, healthy bool) {
	s, rs := z.s, z.rs
	defer func() {
		if v := recover(); v != nil {
			s.recovered(rs, rs.st.Rank, v)
			z.forgetSeq()
			if connected {
				s.setConnected(rs, false, false)
			}
			healthy = false
		}
	}()
	sctx, cancel := context.WithCancel(ctx)
	defer cancel()
	peer, err := dialZMTP(sctx, rs.st.Endpoint, zmq4.Sub, &s.m.cfg)
	if err != nil {
		return false, !z.inputError(err)
	}
	defer peer.close()
	// An empty topic subscribes to every publisher topic.
	if err := peer.send([]byte{1}); err != nil {
		s.recvError(rs, fmt.Errorf("subscribe to %s: %w", rs.st.Endpoint, err))
		return false, true
	}
	connected = true
	s.setConnected(rs, true, reconnect)
	defer func() {
		if connected {
			s.setConnected(rs, false, false)
		}
	}()
	if rs.replay != "" {
		z.replayOnConnect(ctx)
	}
	for {
		frames, err := peer.recv()
		if err != nil {
			if ctx.Err() != nil {
				return true, true
			}
			return true, !z.inputError(fmt.Errorf("receive from %s: %w", rs.st.Endpoint, err))
		}
		z.handleFrames(ctx, frames)
	}
}

// inputError counts a failed dial or receive: as refused input when the
// peer broke a limit or the framing, else as a receive error. It reports
// whether the input was refused.
func (z *zmqRank) inputError(err error) bool {
	switch {
	case errors.Is(err, ErrInputTooLarge):
		z.s.reject(z.rs, rejectMessageTooLarge, err)
		return true
	case errors.Is(err, ErrBadFraming):
		z.s.reject(z.rs, rejectBadFraming, err)
		return true
	}
	z.s.recvError(z.rs, err)
	return false
}

// handleFrames validates one live message: [topic, seq(8 bytes BE), payload].
func (z *zmqRank) handleFrames(ctx context.Context, frames [][]byte) {
	if len(frames) != 3 {
		z.s.decodeError(z.rs, fmt.Errorf("message has %d frames, want 3 (topic, seq, payload)", len(frames)))
		return
	}
	if len(frames[1]) != 8 {
		z.s.decodeError(z.rs, fmt.Errorf("seq frame has %d bytes, want 8", len(frames[1])))
		return
	}
	z.handleLive(ctx, binary.BigEndian.Uint64(frames[1]), frames[2])
}

// handleLive applies one live batch after checking its sequence number.
func (z *zmqRank) handleLive(ctx context.Context, seq uint64, payload []byte) {
	rs := z.rs
	if len(rs.dups) > 0 {
		if z.replayedDup(seq, payload) {
			z.c.skip(skipDuplicate, 1)
			z.flush(0, false)
			return
		}
		// Once live traffic is past the replayed range nothing can repeat
		// it any more; one batch of slack lets a reordered (held back)
		// batch of the range still be recognised.
		if hi := rs.dups[len(rs.dups)-1].seq; seq > hi && seq-hi > 1 {
			z.closeDups()
		}
	}
	if rs.st.HasSeq {
		last := rs.st.LastSeq
		switch {
		case seq == last+1:
		case seq == last && xxh3.Hash(payload) == rs.lastSum:
			z.c.skip(skipDuplicate, 1)
			z.flush(0, false)
			return
		case seq <= last:
			// Sequence numbers restart at 0 with the engine process, and
			// vLLM sends no AllBlocksCleared on restart: the old blocks
			// are gone. Genuine duplicates of replayed batches were
			// skipped above by their bytes; a seq alone cannot tell them
			// apart, since the new process reuses the replayed seqs.
			z.s.reset(rs, rs.st.Rank, resetSeqBackwards)
			z.forgetSeq()
			if seq > 0 {
				// The new process's batches 0..seq-1 came before we
				// resubscribed.
				z.recover(ctx, 0, seq)
			}
		default:
			z.s.countGap(z.rs)
			z.recover(ctx, last+1, seq)
		}
	}
	z.apply(seq, payload)
}

// forgetSeq drops the sequence state after a reset.
func (z *zmqRank) forgetSeq() {
	z.s.mu.Lock()
	z.rs.st.HasSeq, z.rs.st.LastSeq = false, 0
	z.s.mu.Unlock()
	z.rs.lastSum = 0
	z.closeDups()
}

// replayedDup reports whether a live batch repeats a batch of the duplicate
// window (same seq, same bytes) after the last one it matched. A restarted
// engine reuses the seqs but not the bytes: its batches carry a new
// timestamp, and its first one is usually AllBlocksCleared.
func (z *zmqRank) replayedDup(seq uint64, payload []byte) bool {
	rs := z.rs
	d := rs.dups[rs.dupNext:]
	i, ok := slices.BinarySearchFunc(d, seq, func(e seqSum, s uint64) int { return cmp.Compare(e.seq, s) })
	if !ok || d[i].sum != xxh3.Hash(payload) {
		return false
	}
	rs.dupNext += i + 1
	return true
}

// openDups starts a new duplicate window for a replay, holding the batch
// the publisher had applied last before it, if any.
func (z *zmqRank) openDups() {
	z.closeDups()
	if z.rs.st.HasSeq {
		z.rs.dups = append(z.rs.dups, seqSum{z.rs.st.LastSeq, z.rs.lastSum})
	}
}

func (z *zmqRank) closeDups() { z.rs.dups, z.rs.dupNext = nil, 0 }

// applyReplayed applies a batch received from the replay endpoint and adds
// it to the duplicate window: the SUB may deliver it too.
func (z *zmqRank) applyReplayed(seq uint64, payload []byte) {
	z.apply(seq, payload)
	z.rs.dups = append(z.rs.dups, seqSum{seq, z.rs.lastSum})
}

// recover fetches batches from..seq-1 from the replay endpoint before the
// live batch seq is applied; what cannot be replayed is lost.
func (z *zmqRank) recover(ctx context.Context, from, seq uint64) {
	missing := seq - from
	if z.rs.replay != "" {
		missing = z.replayRange(ctx, from, seq-1)
		if missing == 0 {
			return
		}
	}
	z.lost(missing, fmt.Sprintf("lost %d event batches before seq %d", missing, seq))
}

// lost applies the documented recovery for events that cannot be replayed:
// the publisher is marked degraded; a small loss keeps the blocks (a few
// stale keys cost a cache miss at worst), a large one clears them (the
// inventory then under-reports until the engine re-stores blocks).
func (z *zmqRank) lost(missing uint64, reason string) {
	z.s.setDegraded(z.rs, reason)
	if missing > z.s.m.cfg.GapKeepWindow {
		z.s.reset(z.rs, z.rs.st.Rank, resetGap)
	}
}

// apply decodes and applies one batch and advances the sequence.
func (z *zmqRank) apply(seq uint64, payload []byte) {
	s, rs := z.s, z.rs
	if err := z.dec.Decode(payload, &z.b); err != nil {
		// The batch is consumed: replaying it would return the same bytes.
		// Nothing of it was applied (decoding finishes before applying).
		z.b.Trim()
		if errors.Is(err, ErrBatchLimit) {
			s.reject(rs, rejectBatchLimit, fmt.Errorf("seq %d: %w", seq, err))
			z.lost(1, fmt.Sprintf("batch seq %d refused: %v", seq, err))
		} else {
			s.decodeError(rs, fmt.Errorf("seq %d: %w", seq, err))
		}
		s.mu.Lock()
		rs.st.LastSeq, rs.st.HasSeq = seq, true
		s.mu.Unlock()
		rs.lastSum = xxh3.Hash(payload)
		return
	}
	s.applyBatch(rs, &z.b, &z.c)
	z.b.Trim()
	rs.lastSum = xxh3.Hash(payload)
	z.flush(seq, true)
}

func (z *zmqRank) flush(seq uint64, hasSeq bool) {
	z.s.flushCounts(z.rs, &z.c, seq, hasSeq)
	sk := z.c.skipped
	clear(sk)
	z.c = applyCounts{skipped: sk}
}

// replayOnConnect rebuilds the publisher's state from its replay buffer
// after a (re)connect.
//
// First connect: every buffered batch is applied (the engine's cache
// predates the gateway).
//
// Reconnect: replay starts at the last applied seq. If the engine returns
// that batch unchanged it is the same process and only the newer batches
// are applied. If it returns a different batch under that seq, or nothing
// at all (its seqs are all lower), the engine restarted: the publisher's
// blocks are cleared and rebuilt from seq 0. If its buffer no longer holds
// the last seq, the batches in between are lost (degraded).
//
// When replay is unavailable the first live message decides instead (see
// handleLive). Either way the batches a replay applies form the duplicate
// window: live batches are skipped only when they repeat them (see
// replayedDup), so a restart right after the replay is still one.
func (z *zmqRank) replayOnConnect(ctx context.Context) {
	rs := z.rs
	if !rs.st.HasSeq {
		z.replayRange(ctx, 0, ^uint64(0))
		return
	}
	last, lastSum := rs.st.LastSeq, rs.lastSum
	z.openDups()
	first, restarted := true, false
	lostBefore := uint64(0)
	n, result, err := z.fetchReplay(ctx, last, func(seq uint64, payload []byte) bool {
		if first {
			first = false
			switch {
			case seq == last && xxh3.Hash(payload) == lastSum:
				return true
			case seq <= last:
				restarted = true
				return false
			case seq > last+1:
				lostBefore = seq - last - 1
			}
		}
		if seq <= rs.st.LastSeq {
			return true
		}
		z.applyReplayed(seq, payload)
		return true
	})
	z.s.countReplay(rs, result, err)
	switch {
	case err != nil:
		return
	case restarted || n == 0:
		z.s.reset(rs, rs.st.Rank, resetRestart)
		z.forgetSeq()
		z.replayRange(ctx, 0, ^uint64(0))
		return
	case lostBefore > 0:
		z.s.countGap(z.rs)
		z.lost(lostBefore, fmt.Sprintf("replay buffer no longer holds %d batches after seq %d", lostBefore, last))
	}
}

// replayRange applies buffered batches with from <= seq <= to, in order, and
// returns how many seqs of that range it could not get. An unbounded range
// (to = max) only reports holes between the batches it received.
func (z *zmqRank) replayRange(ctx context.Context, from, to uint64) (missing uint64) {
	rs := z.rs
	had := rs.st.HasSeq
	z.openDups()
	next := from
	// An unbounded replay on first contact starts wherever the engine's
	// buffer starts; only holes after its first batch are losses.
	lead := to != ^uint64(0) || had
	_, result, err := z.fetchReplay(ctx, from, func(seq uint64, payload []byte) bool {
		if seq > to {
			return false
		}
		if seq < next || (rs.st.HasSeq && seq <= rs.st.LastSeq) {
			return true
		}
		if lead {
			missing += seq - next
		}
		lead = true
		z.applyReplayed(seq, payload)
		next = seq + 1
		return seq < to
	})
	if to != ^uint64(0) && next <= to {
		missing += to - next + 1
	}
	if err == nil && missing > 0 {
		result = replayIncomplete
	}
	z.s.countReplay(rs, result, err)
	return missing
}

func (s *subscription) countGap(rs *rankState) {
	s.mu.Lock()
	rs.st.Gaps++
	s.st.Gaps++
	s.mu.Unlock()
	s.met.gaps.Inc()
}

func (s *subscription) countReplay(rs *rankState, result string, err error) {
	s.mu.Lock()
	if result == replayOK {
		rs.st.Replays++
		s.st.Replays++
	} else {
		rs.st.ReplayFailures++
		s.st.ReplayFailures++
		if err != nil {
			rs.st.LastError = err.Error()
		}
	}
	s.mu.Unlock()
	s.met.replays[result].Inc()
}

// replayInputError counts a replay exchange the peer broke by a limit or
// bad framing; other failures are counted by the replay result.
func (z *zmqRank) replayInputError(err error) {
	switch {
	case errors.Is(err, ErrInputTooLarge):
		z.s.reject(z.rs, rejectMessageTooLarge, err)
	case errors.Is(err, ErrBadFraming):
		z.s.reject(z.rs, rejectBadFraming, err)
	}
}

// errReplayTimeout is reported when the replay endpoint does not finish in
// Config.ReplayTimeout.
var errReplayTimeout = errors.New("replay timed out")

// fetchReplay asks the publisher's replay ROUTER for every buffered batch
// with seq >= from and calls fn for each, in the order received, until fn
// returns false or the end marker arrives. It returns the number of batches
// received.
//
// Wire format (vLLM vllm/distributed/kv_events.py, SGLang's copy): the
// DEALER sends ["", seq8]; the ROUTER then sees [identity, "", seq8]. Each
// reply arrives as ["", topic, seq8, payload] (current vLLM) or
// ["", seq8, payload] (older vLLM, SGLang); the end marker has seq
// 0xffffffffffffffff and an empty payload.
func (z *zmqRank) fetchReplay(ctx context.Context, from uint64, fn func(seq uint64, payload []byte) bool) (int, string, error) {
	s, rs := z.s, z.rs
	cfg := &s.m.cfg
	rctx, cancel := context.WithTimeout(ctx, cfg.ReplayTimeout)
	defer cancel()
	peer, err := dialZMTP(rctx, rs.replay, zmq4.Dealer, cfg)
	if err != nil {
		z.replayInputError(err)
		return 0, replayUnavailable, fmt.Errorf("replay dial %s: %w", rs.replay, err)
	}
	defer peer.close()

	var seq8 [8]byte
	binary.BigEndian.PutUint64(seq8[:], from)
	if err := peer.send([]byte{}, seq8[:]); err != nil {
		return 0, replayUnavailable, fmt.Errorf("replay request to %s: %w", rs.replay, err)
	}
	n := 0
	for {
		frames, err := peer.recv()
		if err != nil {
			if rctx.Err() != nil && ctx.Err() == nil {
				err = errReplayTimeout
			}
			z.replayInputError(err)
			result := replayIncomplete
			if n == 0 {
				result = replayUnavailable
			}
			return n, result, fmt.Errorf("replay from %s after %d batches: %w", rs.replay, n, err)
		}
		f := frames
		if len(f) > 0 && len(f[0]) == 0 {
			f = f[1:] // the envelope delimiter
		}
		if len(f) == 3 {
			f = f[1:] // the topic (current vLLM)
		}
		if len(f) != 2 || len(f[0]) != 8 {
			s.decodeError(rs, fmt.Errorf("replay reply with %d frames", len(frames)))
			continue
		}
		seq := binary.BigEndian.Uint64(f[0])
		if seq == ^uint64(0) && len(f[1]) == 0 {
			return n, replayOK, nil
		}
		if n >= cfg.ReplayMaxBatches {
			// Each applied batch is remembered until live traffic passes
			// it (the duplicate window): a peer streaming batches for the
			// whole timeout must not grow it without bound.
			err := fmt.Errorf("%w: replay from %s sent more than %d batches", ErrInputTooLarge, rs.replay, cfg.ReplayMaxBatches)
			s.reject(rs, rejectReplayTooLong, err)
			return n, replayIncomplete, err
		}
		n++
		if !fn(seq, f[1]) {
			return n, replayOK, nil
		}
	}
}
