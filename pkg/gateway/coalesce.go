package gateway

import (
	"context"
	"strconv"
	"sync"
	"sync/atomic"
	"time"
)

// Prefill coalescing.
//
// When a request is routed to an endpoint because of blocks that endpoint
// is still computing for an earlier request (the blocks are speculative in
// the inventory: routed there, not yet confirmed by the engine's events),
// forwarding it at once makes the engine compute the same prompt prefix a
// second time: engines share only blocks whose prefill has finished. That
// is the common case for the second turn of a chat sent while the first
// turn's long prompt is still in prefill, and for siblings (best-of-N,
// agent fan-out) that share a prefix no engine holds yet. The gateway
// instead holds the follower until the leader's first response byte (its
// prefill is done and its blocks are in the engine's cache), bounded by
// CoalesceWait, and then forwards it to the same endpoint, which now only
// computes the follower's own suffix. Waiting is never longer than the
// recomputation it saves, because the follower waits only when the blocks
// it shares with the leader are at least half of the leader's own prefill
// work, and the leader started first.
//
// Waits always point at a request routed earlier, so they cannot form a
// cycle; a leader that fails or is cancelled releases its followers at its
// end, and they are then forwarded as usual.

// maxLeaderKeys bounds the block keys one leader registers (about 64k
// tokens at 16 tokens per block); longer prompts register their first
// maxLeaderKeys uncached blocks.
const maxLeaderKeys = 4096

// leader is one request whose prefill other requests may wait for.
type leader struct {
	done     chan struct{}
	once     sync.Once
	uncached int64 // the leader's predicted uncached prompt tokens
	// followers counts the requests held for this one; the prefill queue
	// weighs the leader by them.
	followers atomic.Int32
}

// followerCount is how many requests wait for l (0 for nil).
func (l *leader) followerCount() int32 {
	if l == nil {
		return 0
	}
	return l.followers.Load()
}

// release wakes the followers; later calls do nothing.
func (l *leader) release() { l.once.Do(func() { close(l.done) }) }

type leaderKey struct {
	service uint32
	ep      int
	key     uint64
}

// leaders maps each block a pending request will compute, on its endpoint,
// to that request, and counts the followers held per endpoint.
type leaders struct {
	mu sync.Mutex
	m  map[leaderKey]*leader
	// held counts followers waiting per (service, endpoint). They are part
	// of the endpoint's load: they will all be sent there, and a router
	// that did not see them would keep choosing the endpoint whose load
	// looks low because its requests are held, piling a hot prefix there.
	held map[heldKey]int
}

type heldKey struct {
	service uint32
	ep      int
}

// hold counts one follower held for ep and returns its release.
func (ls *leaders) hold(service uint32, ep int) func() {
	k := heldKey{service, ep}
	ls.mu.Lock()
	if ls.held == nil {
		ls.held = make(map[heldKey]int)
	}
	ls.held[k]++
	ls.mu.Unlock()
	return func() {
		ls.mu.Lock()
		if ls.held[k]--; ls.held[k] <= 0 {
			delete(ls.held, k)
		}
		ls.mu.Unlock()
	}
}

// heldFor returns how many followers are held for ep.
func (ls *leaders) heldFor(service uint32, ep int) int {
	ls.mu.Lock()
	defer ls.mu.Unlock()
	return ls.held[heldKey{service, ep}]
}

// register records keys (the blocks the request computes on ep) and returns
// the function that ends the leadership; calling it more than once is
// harmless.
func (ls *leaders) register(service uint32, ep int, keys []uint64, uncached int64) (func(), *leader) {
	return ls.registerKeys(service, ep, keys, uncached, true)
}

// registerKeys is register; without replace, a key another leader holds
// stays with it (another node's announcement never displaces a request of
// this node, whose end is certain to be seen).
func (ls *leaders) registerKeys(service uint32, ep int, keys []uint64, uncached int64, replace bool) (func(), *leader) {
	if len(keys) == 0 {
		return func() {}, nil
	}
	keys = keys[:min(len(keys), maxLeaderKeys)]
	l := &leader{done: make(chan struct{}), uncached: uncached}
	ls.mu.Lock()
	if ls.m == nil {
		ls.m = make(map[leaderKey]*leader)
	}
	for _, k := range keys {
		lk := leaderKey{service, ep, k}
		if _, held := ls.m[lk]; held && !replace {
			continue
		}
		ls.m[lk] = l
	}
	ls.mu.Unlock()
	kept := append([]uint64(nil), keys...)
	var once sync.Once
	end := func() {
		once.Do(func() {
			ls.mu.Lock()
			for _, k := range kept {
				lk := leaderKey{service, ep, k}
				if ls.m[lk] == l {
					delete(ls.m, lk)
				}
			}
			ls.mu.Unlock()
			l.release()
		})
	}
	return end, l
}

// find returns the pending request computing block key on ep, if any.
func (ls *leaders) find(service uint32, ep int, key uint64) *leader {
	ls.mu.Lock()
	defer ls.mu.Unlock()
	return ls.m[leaderKey{service, ep, key}]
}

// forget drops a removed service's leaders, releasing their followers.
func (ls *leaders) forget(service uint32) {
	ls.mu.Lock()
	defer ls.mu.Unlock()
	for k, l := range ls.m {
		if k.service == service {
			delete(ls.m, k)
			l.release()
		}
	}
}

// waitOutcome is how a follower's wait ended, the "outcome" label of
// loxilb_kv_coalesce_total.
type waitOutcome string

const (
	waitReleased  waitOutcome = "released"  // the leader's first byte came back (or it ended)
	waitTimeout   waitOutcome = "timeout"   // CoalesceWait elapsed first
	waitCancelled waitOutcome = "cancelled" // the client went away
)

// lead registers a request as the leader of computed, the blocks it
// computes on ep (uncached: its predicted uncached tokens), and announces
// it to the other nodes (remote.go); end ends both. l is nil when computed
// is empty.
func (g *Gateway) lead(st *service, ep int, computed []uint64, uncached int64) (end func(), l *leader) {
	end, l = g.leaders.register(st.id, ep, computed, uncached)
	if l != nil {
		local, told := end, g.announce(st, ep, computed, uncached)
		end = func() { local(); told() }
	}
	return end, l
}

// follow holds a request routed to ep until l's prefill is done (or
// CoalesceWait elapsed, or ctx ended), counted as ep's load meanwhile and
// as one of l's followers, and counts how the wait ended.
func (g *Gateway) follow(ctx context.Context, st *service, ep int, l *leader) waitOutcome {
	start := time.Now()
	unhold := g.leaders.hold(st.id, ep)
	l.followers.Add(1)
	out := l.wait(ctx, g.cfg.CoalesceWait)
	l.followers.Add(-1)
	unhold()
	g.m.coalesced.WithLabelValues(st.label, strconv.Itoa(ep), string(out)).Inc()
	g.m.coalesceWait.WithLabelValues(st.label).Observe(time.Since(start).Seconds())
	return out
}

// wait blocks until l's prefill is done, max has elapsed or ctx ends.
func (l *leader) wait(ctx context.Context, max time.Duration) waitOutcome {
	t := time.NewTimer(max)
	defer t.Stop()
	select {
	case <-l.done:
		return waitReleased
	case <-t.C:
		return waitTimeout
	case <-ctx.Done():
		return waitCancelled
	}
}
