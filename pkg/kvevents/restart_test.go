package kvevents

import (
	"fmt"
	"slices"
	"testing"
	"time"
)

// clearedBatch is one AllBlocksCleared event, what an engine (and the
// emulator) publishes as seq 0 of a new process.
func clearedBatch() []byte {
	var m mp
	m.arr(3).f64(0).arr(1).arr(1).str("AllBlocksCleared").fix(0)
	return m.Bytes()
}

// replayedPublisher starts a vLLM publisher whose replay buffer holds
// storedBatch(1), storedBatch(2), storedBatch(3) as seqs 0..2, subscribes,
// and waits until the initial replay has applied them.
func replayedPublisher(t *testing.T) (*harness, *publisher, *replayServer) {
	t.Helper()
	p := newPublisher(t)
	rs := newReplayServer(t, true)
	for seq, k := range []uint64{1, 2, 3} {
		rs.put(uint64(seq), storedBatch(k))
	}
	spec := vllmSpec(p.port)
	spec.ReplayEndpoint = fmt.Sprintf("tcp://127.0.0.1:%d", rs.port)
	h := startManager(t, fastConfig(), spec)
	waitFor(t, "initial replay", func() bool {
		st := h.status(7, 2)
		return st.Ranks[0].HasSeq && st.Ranks[0].LastSeq == 2 && slices.Equal(h.sink.keys(7, 2, 0), []uint64{1, 2, 3})
	})
	return h, p, rs
}

// restartEngine emulates an engine restart on the same PUB socket after the
// initial replay: the new process's buffer starts over with
// AllBlocksCleared at seq 0, which is published until the subscriber has
// acted on it (a SUB only receives what is published after its
// subscription reached the PUB). Then the new process stores 10, 11, 12 as
// seqs 1..3, reusing seqs the replay already applied for the old process.
func restartEngine(t *testing.T, h *harness, p *publisher, rs *replayServer) {
	t.Helper()
	rs.mu.Lock()
	rs.buf = map[uint64][]byte{0: clearedBatch()}
	rs.mu.Unlock()
	waitFor(t, "restart batch seq 0 applied", func() bool {
		st := h.status(7, 2)
		if st.Resets >= 1 && st.Ranks[0].HasSeq && st.Ranks[0].LastSeq == 0 && len(h.sink.keys(7, 2, 0)) == 0 {
			return true
		}
		p.send(0, clearedBatch())
		time.Sleep(10 * time.Millisecond)
		return false
	})
	for seq, k := range []uint64{10, 11, 12} {
		rs.put(uint64(seq+1), storedBatch(k))
		p.send(uint64(seq+1), storedBatch(k))
	}
	waitFor(t, "new process batches applied", func() bool { return h.status(7, 2).Ranks[0].LastSeq == 3 })
	if got := h.sink.keys(7, 2, 0); !slices.Equal(got, []uint64{10, 11, 12}) {
		t.Fatalf("inventory after restart = %v, want [10 11 12]", got)
	}
	st := h.status(7, 2)
	if st.Resets != 1 || st.Degraded || st.Gaps != 0 || st.ReplayFailures != 0 {
		t.Fatalf("status after restart = %+v", st)
	}
	if n := h.metric("loxilb_kv_resets_total", map[string]string{"service": "7", "ep_idx": "2", "reason": resetSeqBackwards}); n != 1 {
		t.Fatalf("seq_backwards resets = %v, want 1", n)
	}
}

// An engine that restarts after the subscriber replayed its buffer, before
// any live batch arrived: the new process's seqs 0..N are the ones the
// replay applied, but they are a restart, not duplicates.
func TestRestartRightAfterInitialReplay(t *testing.T) {
	h, p, rs := replayedPublisher(t)
	restartEngine(t, h, p, rs)
}

// Live duplicates of replayed batches are skipped, and a restart after them
// is still detected.
func TestRestartAfterReplayedDuplicates(t *testing.T) {
	h, p, rs := replayedPublisher(t)
	// The last replayed batch also arrives live (it was queued on the SUB
	// while the replay ran): same seq, same bytes.
	waitFor(t, "live duplicate of seq 2 skipped", func() bool {
		if h.status(7, 2).EventsSkipped > 0 {
			return true
		}
		p.send(2, storedBatch(3))
		time.Sleep(10 * time.Millisecond)
		return false
	})
	st := h.status(7, 2)
	if st.Resets != 0 || st.Ranks[0].LastSeq != 2 || !slices.Equal(h.sink.keys(7, 2, 0), []uint64{1, 2, 3}) {
		t.Fatalf("a duplicate changed the state: %+v, inventory %v", st, h.sink.keys(7, 2, 0))
	}
	if n := h.metric("loxilb_kv_events_skipped_total", map[string]string{"service": "7", "ep_idx": "2", "reason": skipDuplicate}); n == 0 {
		t.Fatal("duplicate not counted")
	}
	restartEngine(t, h, p, rs)
}

// A batch the publisher held back (reordered) arrives after the replay
// that filled the gap it left: it is a duplicate, not a restart.
func TestReorderedBatchAfterGapReplay(t *testing.T) {
	h, p, rs := replayedPublisher(t)
	rs.put(3, storedBatch(4))
	p.handshake(h, 7, 2, 0, 3, storedBatch(4))
	// Seq 4 is held back by the publisher and sent after seq 5.
	rs.put(4, removedBatch(1))
	rs.put(5, storedBatch(6))
	p.send(5, storedBatch(6))
	p.send(4, removedBatch(1))
	p.send(6, storedBatch(7))
	waitFor(t, "seq 6", func() bool { return h.status(7, 2).Ranks[0].LastSeq == 6 })
	if got := h.sink.keys(7, 2, 0); !slices.Equal(got, []uint64{2, 3, 4, 6, 7}) {
		t.Fatalf("inventory = %v", got)
	}
	st := h.status(7, 2)
	if st.Resets != 0 || st.Gaps != 1 || st.Degraded {
		t.Fatalf("status = %+v", st)
	}
}

// After a reconnect whose replay showed the same process, a restart that
// reuses the replayed seqs is still detected.
func TestRestartAfterReconnectReplay(t *testing.T) {
	h, p, rs := replayedPublisher(t)
	port := p.port
	p.sock.Close()
	waitFor(t, "disconnect", func() bool { return !h.status(7, 2).Connected })
	// While disconnected the same process published seqs 3 and 4.
	rs.put(3, storedBatch(4))
	rs.put(4, storedBatch(5))
	waitFor(t, "rebind", func() bool {
		var err error
		p, err = newPublisherOn(t, port)
		return err == nil
	})
	waitFor(t, "reconnect replay", func() bool { return h.status(7, 2).Ranks[0].LastSeq == 4 })
	if st := h.status(7, 2); st.Resets != 0 || !slices.Equal(h.sink.keys(7, 2, 0), []uint64{1, 2, 3, 4, 5}) {
		t.Fatalf("reconnect replay: %+v, inventory %v", st, h.sink.keys(7, 2, 0))
	}
	restartEngine(t, h, p, rs)
}
