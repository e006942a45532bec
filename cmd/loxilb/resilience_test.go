package main

import (
	"io"
	"strings"
	"testing"
	"time"

	"github.com/loxilb-llm/loxilb/pkg/outlier"
)

// TestResilienceFlags: defaults, environment equivalents, and bad values
// that stop the daemon naming the flag or variable.
func TestResilienceFlags(t *testing.T) {
	cfg, err := parseFlags(nil, noEnv, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	o := cfg.outlier
	if o.GatewayFailures != 3 || o.ServerErrors != 5 || o.BaseEjection != 30*time.Second || o.MaxEjection != 300*time.Second ||
		o.MaxEjectedPercent != 50 || o.Disabled || o.PDOriginErrors != 0 {
		t.Errorf("outlier defaults %+v", o)
	}
	if p := cfg.proxyConfig(); p.MaxRetries != 2 || p.ShutdownGrace != 30*time.Second {
		t.Errorf("proxy retries %d, drain %v", p.MaxRetries, p.ShutdownGrace)
	}
	env := map[string]string{"LOXILB_OUTLIER_CONSECUTIVE_5XX": "2", "LOXILB_DRAIN_TIMEOUT": "5s", "LLB_PD_ORIGIN_ERR_THRESHOLD": "4",
		"LOXILB_OUTLIER_MAX_EJECTED_PERCENT": "0"}
	cfg, err = parseFlags([]string{"--proxy-max-retries", "0"}, func(k string) (string, bool) { v, ok := env[k]; return v, ok }, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	if cfg.outlier.ServerErrors != 2 || cfg.outlier.PDOriginErrors != 4 || !cfg.outlier.Disabled {
		t.Errorf("outlier from env %+v", cfg.outlier)
	}
	if p := cfg.proxyConfig(); p.MaxRetries >= 0 || p.ShutdownGrace != 5*time.Second {
		t.Errorf("--proxy-max-retries 0 gave %d, drain %v", p.MaxRetries, p.ShutdownGrace)
	}
	if _, err := outlier.New(cfg.outlier, nil, nil); err != nil {
		t.Errorf("parsed config refused by the detector: %v", err)
	}
	for _, c := range []struct {
		args []string
		env  map[string]string
		name string
	}{
		{[]string{"--outlier-consecutive-gateway-failures", "0"}, nil, "--outlier-consecutive-gateway-failures"},
		{[]string{"--outlier-consecutive-5xx", "1001"}, nil, "--outlier-consecutive-5xx"},
		{[]string{"--outlier-base-ejection", "1ms"}, nil, "--outlier-base-ejection"},
		{[]string{"--outlier-max-ejection", "1s"}, nil, "--outlier-max-ejection"},
		{[]string{"--outlier-max-ejected-percent", "101"}, nil, "--outlier-max-ejected-percent"},
		{[]string{"--proxy-max-retries", "17"}, nil, "--proxy-max-retries"},
		{[]string{"--drain-timeout", "-1s"}, nil, "--drain-timeout"},
		{nil, map[string]string{"LOXILB_DRAIN_TIMEOUT": "soon"}, "LOXILB_DRAIN_TIMEOUT"},
		{nil, map[string]string{"LOXILB_OUTLIER_CONSECUTIVE_5XX": "many"}, "LOXILB_OUTLIER_CONSECUTIVE_5XX"},
		{nil, map[string]string{"LLB_PD_ORIGIN_ERR_THRESHOLD": "0"}, "LLB_PD_ORIGIN_ERR_THRESHOLD"},
	} {
		_, err := parseFlags(c.args, func(k string) (string, bool) { v, ok := c.env[k]; return v, ok }, io.Discard)
		if err == nil || !strings.Contains(err.Error(), c.name) {
			t.Errorf("%v %v: want an error naming %s, got %v", c.args, c.env, c.name, err)
		}
	}
}
