package main

import (
	"flag"
	"fmt"
	"strconv"
	"time"

	"github.com/loxilb-llm/loxilb/pkg/outlier"
	"github.com/loxilb-llm/loxilb/pkg/proxy"
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
	// envErr is the first environment value that did not parse; reported
	// after flag parsing so the message names the variable.
	envErr error
}

// EnvPDOriginErrThreshold is the P/D circuit breaker's threshold:
// consecutive origin errors (5xx or gateway failures) of one prefill or
// decode endpoint that eject it.
const EnvPDOriginErrThreshold = "LLB_PD_ORIGIN_ERR_THRESHOLD"

func (r *resilience) register(fs *flag.FlagSet, env func(string) (string, bool)) {
	envInt := func(name string, def int) int {
		v, ok := env(name)
		if !ok || v == "" {
			return def
		}
		n, err := strconv.Atoi(v)
		if err != nil && r.envErr == nil {
			r.envErr = fmt.Errorf("%s=%q: want an integer", name, v)
		}
		return n
	}
	envDur := func(name string, def time.Duration) time.Duration {
		v, ok := env(name)
		if !ok || v == "" {
			return def
		}
		d, err := time.ParseDuration(v)
		if err != nil && r.envErr == nil {
			r.envErr = fmt.Errorf("%s=%q: want a duration such as 30s", name, v)
		}
		return d
	}
	fs.IntVar(&r.gatewayFailures, "outlier-consecutive-gateway-failures", envInt("LOXILB_OUTLIER_CONSECUTIVE_GATEWAY_FAILURES", outlier.DefaultGatewayFailures),
		"consecutive connect failures or resets before a response that eject a mode-4 endpoint (1..1000; env LOXILB_OUTLIER_CONSECUTIVE_GATEWAY_FAILURES)")
	fs.IntVar(&r.serverErrors, "outlier-consecutive-5xx", envInt("LOXILB_OUTLIER_CONSECUTIVE_5XX", outlier.DefaultServerErrors),
		"consecutive 5xx answers that eject a mode-4 endpoint (1..1000; env LOXILB_OUTLIER_CONSECUTIVE_5XX)")
	fs.DurationVar(&r.baseEjection, "outlier-base-ejection", envDur("LOXILB_OUTLIER_BASE_EJECTION", outlier.DefaultBaseEjection),
		"first ejection's length, doubled for each repeated ejection (100ms..1h; env LOXILB_OUTLIER_BASE_EJECTION)")
	fs.DurationVar(&r.maxEjection, "outlier-max-ejection", envDur("LOXILB_OUTLIER_MAX_EJECTION", outlier.DefaultMaxEjection),
		"longest ejection (--outlier-base-ejection..24h; env LOXILB_OUTLIER_MAX_EJECTION)")
	fs.IntVar(&r.maxEjectedPct, "outlier-max-ejected-percent", envInt("LOXILB_OUTLIER_MAX_EJECTED_PERCENT", outlier.DefaultMaxEjectedPercent),
		"largest share of a rule's endpoints ejected at once; the last one never is (0..100, 0 turns ejection off; env LOXILB_OUTLIER_MAX_EJECTED_PERCENT)")
	fs.IntVar(&r.maxRetries, "proxy-max-retries", proxy.DefaultMaxRetries,
		"further mode-4 endpoints a request is sent to when an attempt failed before the endpoint could start it (connect refused, reset while the request was written); never for a request an endpoint may have started (0..16)")
	fs.DurationVar(&r.drainTimeout, "drain-timeout", envDur("LOXILB_DRAIN_TIMEOUT", 30*time.Second),
		"on SIGTERM, how long in-flight mode-4 requests may run on after the listeners closed; a second SIGTERM exits at once (0..24h; env LOXILB_DRAIN_TIMEOUT)")
}

// outlierConfig validates the settings and returns the detector's
// configuration, with the P/D breaker's threshold from the environment.
func (r *resilience) outlierConfig(getenv func(string) string) (outlier.Config, error) {
	if r.envErr != nil {
		return outlier.Config{}, r.envErr
	}
	if r.maxRetries < 0 || r.maxRetries > 16 {
		return outlier.Config{}, fmt.Errorf("--proxy-max-retries %d: want 0..16", r.maxRetries)
	}
	if r.drainTimeout < 0 || r.drainTimeout > 24*time.Hour {
		return outlier.Config{}, fmt.Errorf("--drain-timeout %v: want 0..24h", r.drainTimeout)
	}
	c := outlier.Config{GatewayFailures: r.gatewayFailures, ServerErrors: r.serverErrors,
		BaseEjection: r.baseEjection, MaxEjection: r.maxEjection, MaxEjectedPercent: r.maxEjectedPct}
	switch {
	case r.gatewayFailures < 1 || r.gatewayFailures > 1000:
		return c, fmt.Errorf("--outlier-consecutive-gateway-failures %d: want 1..1000", r.gatewayFailures)
	case r.serverErrors < 1 || r.serverErrors > 1000:
		return c, fmt.Errorf("--outlier-consecutive-5xx %d: want 1..1000", r.serverErrors)
	case r.baseEjection < 100*time.Millisecond || r.baseEjection > time.Hour:
		return c, fmt.Errorf("--outlier-base-ejection %v: want 100ms..1h", r.baseEjection)
	case r.maxEjection < r.baseEjection || r.maxEjection > 24*time.Hour:
		return c, fmt.Errorf("--outlier-max-ejection %v: want --outlier-base-ejection (%v)..24h", r.maxEjection, r.baseEjection)
	case r.maxEjectedPct < 0 || r.maxEjectedPct > 100:
		return c, fmt.Errorf("--outlier-max-ejected-percent %d: want 0..100", r.maxEjectedPct)
	}
	if r.maxEjectedPct == 0 {
		c.Disabled, c.MaxEjectedPercent = true, outlier.DefaultMaxEjectedPercent
	}
	if v := getenv(EnvPDOriginErrThreshold); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n < 1 || n > 1000 {
			return c, fmt.Errorf("%s=%q: want 1..1000 consecutive origin errors", EnvPDOriginErrThreshold, v)
		}
		c.PDOriginErrors = n
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
