package control

import (
	"context"
	"errors"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/loxilb-llm/loxilb/pkg/lbrule"
)

// Rule states, as the API, loxicmd and the loxilb_rules gauge show them.
const (
	// StateApplied: every stage put the rule into effect.
	StateApplied = "applied"
	// StateDegraded: the rule serves, but a side stage (KV subscriptions,
	// health probes, engine metrics) could not take it; retried.
	StateDegraded = "degraded"
	// StateFailed: the rule does not serve. It is kept, listed and
	// deletable; a stage failure is retried with backoff, an invalid or
	// duplicate rule waits for a change of the rule table.
	StateFailed = "failed"
)

// Reason codes of rule states that no stage's own error names.
const (
	// ReasonDuplicate: another stored rule with a lower id has the same key
	// (or, for mode 4, the same VIP:port); only the first is applied.
	ReasonDuplicate = "RULE_DUPLICATE"
	// ReasonInvalid: a stored rule that no longer validates.
	ReasonInvalid = "RULE_INVALID"
	// ReasonStageFailed: a stage failed as a whole, without naming rules.
	ReasonStageFailed = "STAGE_FAILED"
	// ReasonNotInstalled: the kernel data plane refused the rule's service.
	ReasonNotInstalled = "EBPF_RULE_NOT_INSTALLED"
)

// Default retry backoff of rules a stage could not apply.
const (
	DefaultRetryMin = time.Second
	DefaultRetryMax = 30 * time.Second
)

// RuleStatus is whether a rule is in effect, as of the last reconcile.
type RuleStatus struct {
	State   string // StateApplied, StateDegraded or StateFailed
	Reason  string // reason code; empty when applied
	Message string // what went wrong, naming the stage
	// Since is when the rule entered this state (and reason).
	Since time.Time
	// Attempts counts the apply attempts that failed in a row.
	Attempts int
	// NextRetry is when the daemon tries again; zero when it does not
	// (applied, or only a change of the rule table can help).
	NextRetry time.Time
}

// Option configures a Controller.
type Option func(*Controller)

// WithRetry sets the backoff of failed rules: the first retry after min,
// doubling up to max (defaults DefaultRetryMin, DefaultRetryMax).
func WithRetry(min, max time.Duration) Option {
	return func(c *Controller) { c.retryMin, c.retryMax = min, max }
}

type ctlMetrics struct {
	rules    *prometheus.GaugeVec
	failures *prometheus.CounterVec
}

func newCtlMetrics() *ctlMetrics {
	m := &ctlMetrics{
		rules: prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "loxilb_rules",
			Help: "Rules in the table by status (applied, degraded, failed)."}, []string{"status"}),
		failures: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "loxilb_rule_apply_failures_total",
			Help: "Attempts to apply a rule that failed (retries included), by reason code."}, []string{"reason"}),
	}
	for _, s := range []string{StateApplied, StateDegraded, StateFailed} {
		m.rules.WithLabelValues(s).Set(0)
	}
	return m
}

// backoff is the wait before retry number attempts (1-based).
func (c *Controller) backoff(attempts int) time.Duration {
	d := c.retryMin
	for i := 1; i < attempts && d < c.retryMax; i++ {
		d *= 2
	}
	return min(d, c.retryMax)
}

// reasonOf is the reason code an error carries, or def.
func reasonOf(err error, def string) string {
	var ce *RuleError
	if errors.As(err, &ce) && ce.Reason != "" {
		return ce.Reason
	}
	var le *lbrule.RuleError
	if errors.As(err, &le) && le.Reason != "" {
		return le.Reason
	}
	return def
}

// splitRuleErrors separates a stage's per-rule reports from the rest of
// its error (nil when every leaf is a RuleError).
func splitRuleErrors(err error) ([]*RuleError, error) {
	var rules []*RuleError
	var rest []error
	var walk func(error)
	walk = func(err error) {
		switch u := err.(type) {
		case nil:
		case *RuleError:
			rules = append(rules, u)
		case interface{ Unwrap() []error }:
			for _, e := range u.Unwrap() {
				walk(e)
			}
		case interface{ Unwrap() error }:
			if len(RuleErrors(err)) > 0 {
				walk(u.Unwrap())
				return
			}
			rest = append(rest, err)
		default:
			rest = append(rest, err)
		}
	}
	walk(err)
	return rules, errors.Join(rest...)
}

// updateStatusLocked records the outcome of one reconcile: blocked rules
// (invalid, duplicate) were not handed to the stages, failures are the
// first report per rule, stageErr a failure no rule was named in.
func (c *Controller) updateStatusLocked(blocked, failures map[uint32]*RuleError, stageErr error) {
	now := c.now()
	next := make(map[uint32]RuleStatus, len(c.services))
	counts := map[string]int{}
	for id, s := range c.services {
		prev, had := c.status[id]
		st := RuleStatus{State: StateApplied}
		retry := true
		switch {
		case blocked[id] != nil:
			re := blocked[id]
			st.State, st.Reason, st.Message, retry = StateFailed, re.Reason, re.Error(), false
		case failures[id] != nil:
			re := failures[id]
			st.State, st.Reason, st.Message = StateFailed, re.Reason, re.Error()
			if re.Degraded {
				st.State = StateDegraded
			}
		case stageErr != nil:
			st.State, st.Reason, st.Message = StateDegraded, ReasonStageFailed, stageErr.Error()
		}
		if st.Reason == "" && st.State != StateApplied {
			st.Reason = ReasonStageFailed
		}
		same := had && prev.State == st.State && prev.Reason == st.Reason
		st.Since = now
		if same {
			st.Since = prev.Since
		}
		if st.State != StateApplied && retry {
			if same && prev.NextRetry.After(now) {
				// Tried early (another change reconciled): keep the schedule.
				st.Attempts, st.NextRetry = prev.Attempts, prev.NextRetry
			} else {
				st.Attempts = 1
				if had && prev.State != StateApplied {
					st.Attempts = prev.Attempts + 1
				}
				st.NextRetry = now.Add(c.backoff(st.Attempts))
			}
			c.m.failures.WithLabelValues(st.Reason).Inc()
		} else if st.State != StateApplied && !same {
			c.m.failures.WithLabelValues(st.Reason).Inc()
		}
		if !same {
			key := ""
			if s.Rule != nil {
				key = s.Rule.Key().String()
			}
			if st.State == StateApplied {
				if had {
					c.logger.Info("rule applied", "id", id, "key", key, "after_attempts", prev.Attempts)
				}
			} else {
				c.logger.Warn("rule not in effect", "id", id, "key", key, "status", st.State, "reason", st.Reason,
					"err", st.Message, "retry_in", nonNegative(st.NextRetry, now))
			}
		}
		next[id] = st
		counts[st.State]++
	}
	c.status = next
	for _, s := range []string{StateApplied, StateDegraded, StateFailed} {
		c.m.rules.WithLabelValues(s).Set(float64(counts[s]))
	}
	select {
	case c.wake <- struct{}{}:
	default:
	}
}

func nonNegative(t, now time.Time) time.Duration {
	if t.IsZero() {
		return 0
	}
	return max(t.Sub(now), 0)
}

// nextRetryLocked is the earliest scheduled retry, zero when none is.
func (c *Controller) nextRetryLocked() time.Time {
	var next time.Time
	for _, st := range c.status {
		if !st.NextRetry.IsZero() && (next.IsZero() || st.NextRetry.Before(next)) {
			next = st.NextRetry
		}
	}
	return next
}

// Run retries the rules a stage could not apply, each with its own
// backoff (WithRetry), until ctx ends: a VIP whose port was held comes
// back by itself once the port frees. It always returns nil.
func (c *Controller) Run(ctx context.Context) error {
	timer := time.NewTimer(time.Hour)
	defer timer.Stop()
	for {
		c.mu.Lock()
		next := c.nextRetryLocked()
		c.mu.Unlock()
		timer.Stop()
		var fire <-chan time.Time
		if !next.IsZero() {
			timer.Reset(max(next.Sub(c.now()), 0))
			fire = timer.C
		}
		select {
		case <-ctx.Done():
			return nil
		case <-c.wake:
		case <-fire:
			c.mu.Lock()
			if due := c.nextRetryLocked(); !due.IsZero() && !due.After(c.now()) {
				c.reconcileLocked(ctx)
			}
			c.mu.Unlock()
		}
	}
}
