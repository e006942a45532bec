package proxy

import (
	"context"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// Drain outcomes (label of loxilb_proxy_drain_requests_total).
const (
	drainCompleted = "completed"
	drainCut       = "cut"
)

// drainState counts the requests running while the server shuts down:
// those that finish within ShutdownGrace completed, those still running
// when it ends are cut.
type drainState struct {
	active   atomic.Int64 // requests being served
	draining atomic.Bool  // the listeners are closed, requests run on
	cutting  atomic.Bool  // the drain timeout passed
	done     atomic.Int64 // requests completed during the drain
	outcomes *prometheus.CounterVec
}

func (d *drainState) init(reg prometheus.Registerer) error {
	d.outcomes = prometheus.NewCounterVec(prometheus.CounterOpts{Name: "loxilb_proxy_drain_requests_total",
		Help: "Mode-4 requests in flight when the daemon began its graceful drain, by outcome: completed within the drain timeout, or cut when it passed."},
		[]string{"outcome"})
	if reg != nil {
		return reg.Register(d.outcomes)
	}
	return nil
}

// begin marks a request as running; the returned function ends it.
func (d *drainState) begin() func() {
	d.active.Add(1)
	return d.end
}

func (d *drainState) end() {
	d.active.Add(-1)
	if d.draining.Load() && !d.cutting.Load() {
		d.done.Add(1)
		d.outcomes.WithLabelValues(drainCompleted).Inc()
	}
}

// gracefulStop closes every listener at once, lets the requests in flight
// finish within ShutdownGrace, then cuts the rest.
func (s *Server) gracefulStop() {
	s.mu.Lock()
	if s.shutdown {
		s.mu.Unlock()
		return
	}
	s.shutdown = true
	close(s.done)
	grace := s.table.Load().cfg.ShutdownGrace
	s.mu.Unlock()
	s.dr.draining.Store(true)
	start := time.Now()
	if n := s.dr.active.Load(); n > 0 {
		s.logger.Info("proxy: draining: listeners closed, waiting for requests in flight", "requests", n, "timeout", grace)
	}
	ctx, cancel := context.WithTimeout(context.Background(), grace)
	defer cancel()
	s.h1Shutdown()
	err := s.srv.Shutdown(ctx)
	if err == nil {
		err = s.h1Wait(ctx)
	}
	if err != nil {
		s.dr.cutting.Store(true)
		cut := s.dr.active.Load()
		s.dr.outcomes.WithLabelValues(drainCut).Add(float64(cut))
		s.logger.Warn("proxy: drain timeout passed, cutting the requests still running",
			"timeout", grace, "completed", s.dr.done.Load(), "cut", cut, "err", err)
		s.h1Close()
		_ = s.srv.Close()
	} else if n := s.dr.done.Load(); n > 0 {
		s.logger.Info("proxy: drained", "completed", n, "cut", 0, "took", time.Since(start).Round(time.Millisecond))
	}
	s.closeTransports()
}
