package kvevents

import (
	"strings"
	"testing"
	"time"
)

func TestConfigFromEnv(t *testing.T) {
	env := func(m map[string]string) func(string) string { return func(k string) string { return m[k] } }
	cfg, err := ConfigFromEnv(env(nil))
	if err != nil || cfg.ReplayPortOffset != 1000 || cfg.TRTPollMin != 5*time.Millisecond || cfg.TRTPollMax != 20*time.Millisecond {
		t.Fatalf("defaults = %+v %v", cfg, err)
	}
	cfg, err = ConfigFromEnv(env(map[string]string{EnvReplayPortOffset: "0", EnvTRTPollMinMS: "50", EnvTRTPollMaxMS: "10"}))
	if err != nil || cfg.ReplayPortOffset != 0 || cfg.TRTPollMin != 50*time.Millisecond || cfg.TRTPollMax != 50*time.Millisecond {
		t.Fatalf("overrides = %+v %v", cfg, err)
	}
	for _, bad := range []map[string]string{{EnvReplayPortOffset: "-1"}, {EnvTRTPollMinMS: "0"}, {EnvTRTPollMaxMS: "fast"}} {
		if _, err := ConfigFromEnv(env(bad)); err == nil || !strings.Contains(err.Error(), "_") {
			t.Fatalf("%v: err = %v", bad, err)
		}
	}
}
