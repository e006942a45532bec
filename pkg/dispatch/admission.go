package dispatch

import (
	"context"
	"fmt"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/loxilb-llm/loxilb/pkg/proxy"
	"github.com/prometheus/client_golang/prometheus"
)

// slots is one endpoint's admission state: a counting semaphore of
// MaxInflightPerEP slots plus a bounded count of waiters. inflight counts
// admitted legs whether or not a cap is set, so least-loaded choice works
// without admission control.
type slots struct {
	sem      chan struct{} // nil when uncapped
	waiting  atomic.Int64
	inflight atomic.Int64
	gauge    prometheus.Gauge
}

// admission owns the slots of every (service, endpoint).
type admission struct {
	cfg   Config
	m     *metrics
	mu    sync.Mutex
	eps   map[epKey]*slots
	total atomic.Int64
}

type epKey struct {
	service uint32
	ep      int
}

func newAdmission(cfg Config, m *metrics) *admission {
	return &admission{cfg: cfg, m: m, eps: make(map[epKey]*slots)}
}

func (a *admission) get(service uint32, ep int) *slots {
	k := epKey{service, ep}
	a.mu.Lock()
	defer a.mu.Unlock()
	s := a.eps[k]
	if s == nil {
		s = &slots{gauge: a.m.inflight.WithLabelValues(strconv.FormatUint(uint64(service), 10), strconv.Itoa(ep))}
		if a.cfg.MaxInflightPerEP > 0 {
			s.sem = make(chan struct{}, a.cfg.MaxInflightPerEP)
		}
		a.eps[k] = s
	}
	return s
}

// inFlight reports admitted legs of an endpoint.
func (a *admission) inFlight(service uint32, ep int) int {
	a.mu.Lock()
	s := a.eps[epKey{service, ep}]
	a.mu.Unlock()
	if s == nil {
		return 0
	}
	return int(s.inflight.Load())
}

// forget drops a service's slots (its rule was removed). Legs still in
// flight release into the dropped slots harmlessly.
func (a *admission) forget(service uint32) {
	a.mu.Lock()
	defer a.mu.Unlock()
	for k := range a.eps {
		if k.service == service {
			delete(a.eps, k)
			a.m.inflight.DeleteLabelValues(strconv.FormatUint(uint64(service), 10), strconv.Itoa(k.ep))
		}
	}
}

// acquire takes a slot of the endpoint, waiting at most MaxPark in a queue
// bounded by QueueDepthPerEP. The returned release must be called once.
func (a *admission) acquire(ctx context.Context, service uint32, label string, ep int) (release func(), err error) {
	s := a.get(service, ep)
	done := func() {
		s.inflight.Add(1)
		s.gauge.Inc()
	}
	rel := func() {
		s.inflight.Add(-1)
		s.gauge.Dec()
		if s.sem != nil {
			<-s.sem
		}
	}
	if s.sem == nil {
		done()
		return onceFunc(rel), nil
	}
	select {
	case s.sem <- struct{}{}:
		done()
		return onceFunc(rel), nil
	default:
	}
	epl := strconv.Itoa(ep)
	if s.waiting.Add(1) > int64(a.cfg.QueueDepthPerEP) {
		s.waiting.Add(-1)
		a.m.shed.WithLabelValues(label, epl, "queue_full").Inc()
		return nil, fmt.Errorf("%w: endpoint %d has %d legs in flight and %d waiting", proxy.ErrQueueFull, ep, a.cfg.MaxInflightPerEP, a.cfg.QueueDepthPerEP)
	}
	defer s.waiting.Add(-1)
	a.m.queued.WithLabelValues(label, epl).Inc()
	t := time.NewTimer(a.cfg.MaxPark)
	defer t.Stop()
	select {
	case s.sem <- struct{}{}:
		done()
		return onceFunc(rel), nil
	case <-t.C:
		a.m.shed.WithLabelValues(label, epl, "park_timeout").Inc()
		return nil, fmt.Errorf("%w: endpoint %d stayed at %d legs in flight for %v", proxy.ErrParkTimeout, ep, a.cfg.MaxInflightPerEP, a.cfg.MaxPark)
	case <-ctx.Done():
		return nil, fmt.Errorf("%w: while waiting for endpoint %d: %w", proxy.ErrClientCanceled, ep, ctx.Err())
	}
}

// enter admits one request against MaxTotalInflight.
func (a *admission) enter(label string) (leave func(), err error) {
	if a.cfg.MaxTotalInflight <= 0 {
		return func() {}, nil
	}
	if a.total.Add(1) > int64(a.cfg.MaxTotalInflight) {
		a.total.Add(-1)
		a.m.shed.WithLabelValues(label, "none", "total_cap").Inc()
		return nil, fmt.Errorf("%w: %d requests in flight", proxy.ErrTotalCap, a.cfg.MaxTotalInflight)
	}
	return onceFunc(func() { a.total.Add(-1) }), nil
}

func onceFunc(f func()) func() {
	var once sync.Once
	return func() { once.Do(f) }
}
