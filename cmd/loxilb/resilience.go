package main

import (
	"fmt"
	"time"

	"github.com/loxilb-llm/loxilb/pkg/outlier"
)

// resilience holds the settings of passive health checking (outlier
// ejection), retries and the graceful drain at shutdown.
type resilience struct {
	gatewayFailures int
	serverErrors    int
	baseEjection    time.Duration
	maxEjection     time.Duration
	maxEjectedPct   int
	maxRetries      int
	drainTimeout    time.Duration
	// pdOriginErrors is the P/D circuit breaker's threshold: consecutive
	// origin errors (5xx or gateway failures) of one prefill or decode
	// endpoint that eject it; 0 (unset) uses the two thresholds above.
	pdOriginErrors int
}

// outlierConfig returns the detector's configuration, checking what the
// settings table cannot (the longest ejection is at least the first).
func (r *resilience) outlierConfig() (outlier.Config, error) {
	c := outlier.Config{GatewayFailures: r.gatewayFailures, ServerErrors: r.serverErrors,
		BaseEjection: r.baseEjection, MaxEjection: r.maxEjection, MaxEjectedPercent: r.maxEjectedPct, PDOriginErrors: r.pdOriginErrors}
	if r.maxEjection < r.baseEjection {
		return c, fmt.Errorf("--outlier-max-ejection %v: want --outlier-base-ejection (%v)..24h", r.maxEjection, r.baseEjection)
	}
	if r.maxEjectedPct == 0 {
		c.Disabled, c.MaxEjectedPercent = true, outlier.DefaultMaxEjectedPercent
	}
	return c, nil
}

// proxyRetries maps --proxy-max-retries onto proxy.Config.MaxRetries,
// where 0 means the default and a negative value no retry.
func (r *resilience) proxyRetries() int {
	if r.maxRetries == 0 {
		return -1
	}
	return r.maxRetries
}
