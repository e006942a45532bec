package enginemetrics

import (
	"context"
	"sync"
	"time"
)

// Learning probes.
//
// An observed budget (budget.go) needs two consecutive samples of the
// engine queueing at its peak. Scrapes a second apart rarely see that: an
// engine queues in bursts of tens of milliseconds, so at the routing
// suite's load a vLLM fleet learned no budget in a run, and the gateway's
// prefill queue stayed off. The scraper therefore takes extra samples of
// an endpoint whose budget is still unknown, at most one per probeGap,
// when either
//
//   - this node has more requests open to it than the engine was ever
//     seen running: only then can the engine be queueing at a new peak
//     (an engine short of its budget runs every request it has); or
//   - the last sample saw it queueing at its peak: the next one, a gap
//     later, tells a queue that persists from an instant.
//
// An endpoint never seen running anything stops being probed after
// blindSamples samples that showed nothing running while this node had
// requests open there (a gauge that does not count what the engine runs);
// a regular scrape that sees something running resumes it.
//
// A probe is an ordinary sample: it refreshes the load signals too. Once
// the budget is known the endpoint is sampled at Config.Interval only
// (the peak still grows from those samples). Probing needs
// Config.SelfInFlight for the first trigger; without it only a queue seen
// by a regular scrape is confirmed early.

// probeGap is the least time between two samples of one endpoint taken
// for learning: longer than an engine step, so two samples never see the
// same scheduling instant, short enough to see a burst's queue twice.
const probeGap = 50 * time.Millisecond

// probeTick is how often the probe loop looks for endpoints to sample.
const probeTick = 10 * time.Millisecond

// probeLoop samples the endpoints due for a probe every probeTick until
// ctx ends; each probe runs on its own goroutine, added to wg.
func (s *Scraper) probeLoop(ctx context.Context, wg *sync.WaitGroup) {
	if s.cfg.Interval <= 2*probeGap {
		return // regular scrapes are as frequent as probes would be
	}
	tick := probeTick
	t := time.NewTicker(tick)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		for _, p := range s.dueProbes(time.Now()) {
			wg.Go(func() {
				s.sampleOne(ctx, p.k, p.t)
				s.probeDone(p.k, p.t)
			})
		}
		// Nothing left to learn: look again once per idleProbeTick
		// instead of waking a hundred times a second for nothing.
		next := probeTick
		if !s.learning() {
			next = min(idleProbeTick, s.cfg.Interval)
		}
		if next != tick {
			tick = next
			t.Reset(tick)
		}
	}
}

// idleProbeTick is how often the probe loop looks while no endpoint can
// be probed: a new endpoint, or one whose gauge starts to show what it
// runs, is probed at most this much later.
const idleProbeTick = time.Second

// learning tells whether some endpoint may still be probed: not scraped
// yet, a probe under way, or a budget unknown on a gauge that shows what
// the engine runs.
func (s *Scraper) learning() bool {
	s.mu.RLock()
	defer s.mu.RUnlock()
	for k := range s.targets {
		b := s.budgets[k]
		if b == nil || b.probing {
			return true
		}
		if _, _, ok := b.slots(); ok {
			continue
		}
		if b.peak > 0 || b.blind < blindSamples {
			return true
		}
	}
	return false
}

type probe struct {
	k epKey
	t scrapeTarget
}

// dueProbes returns the endpoints to sample now and marks them probing.
func (s *Scraper) dueProbes(now time.Time) []probe {
	s.mu.Lock()
	defer s.mu.Unlock()
	var out []probe
	for k, t := range s.targets {
		b := s.budgets[k]
		if b == nil || b.probing || now.Sub(b.sampledAt) < probeGap {
			continue // not scraped yet, under way, or sampled just now
		}
		if _, _, ok := b.slots(); ok {
			continue
		}
		if b.saturated == 0 && s.self(k) <= b.peak {
			continue
		}
		if b.peak == 0 && b.blind >= blindSamples {
			continue // its gauge shows nothing of what it runs
		}
		b.probing, b.sampledAt = true, now // a failed probe waits its gap too
		out = append(out, probe{k, t})
	}
	return out
}

// probeDone clears k's probing mark (unless its target changed, which
// dropped its learning state).
func (s *Scraper) probeDone(k epKey, t scrapeTarget) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if b := s.budgets[k]; b != nil && s.targets[k] == t {
		b.probing = false
	}
}
