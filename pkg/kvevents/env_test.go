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
	if cfg.MaxMessageBytes != DefaultMaxMessageBytes || cfg.MaxMessageFrames != DefaultMaxMessageFrames || cfg.MaxBatchEvents != DefaultMaxBatchEvents ||
		cfg.MaxBatchHashes != DefaultMaxBatchHashes || cfg.MaxBatchTokens != DefaultMaxBatchTokens || cfg.TRTMaxHeaderBytes != DefaultTRTMaxHeaderB ||
		cfg.QuarantineVerifyBlocks != DefaultQuarantineVerifyBlocks || cfg.ReplayMaxBatches != DefaultReplayMaxBatches {
		t.Fatalf("limit defaults = %+v", cfg)
	}
	cfg, err = ConfigFromEnv(env(map[string]string{EnvMaxMessageBytes: "1048576", EnvMaxMessageFrames: "8", EnvMaxBatchEvents: "100",
		EnvMaxBatchHashes: "200", EnvMaxBatchTokens: "300", EnvTRTMaxHeaderB: "2048"}))
	if err != nil || cfg.MaxMessageBytes != 1<<20 || cfg.MaxMessageFrames != 8 || cfg.MaxBatchEvents != 100 || cfg.MaxBatchHashes != 200 ||
		cfg.MaxBatchTokens != 300 || cfg.TRTMaxHeaderBytes != 2048 {
		t.Fatalf("limit overrides = %+v %v", cfg, err)
	}
	for _, bad := range []map[string]string{{EnvReplayPortOffset: "-1"}, {EnvTRTPollMinMS: "0"}, {EnvTRTPollMaxMS: "fast"},
		{EnvMaxMessageBytes: "100"}, {EnvMaxMessageBytes: "2147483648"}, {EnvMaxMessageFrames: "3"}, {EnvMaxBatchEvents: "0"},
		{EnvMaxBatchHashes: "x"}, {EnvMaxBatchTokens: "-5"}, {EnvTRTMaxHeaderB: "10"}, {EnvQuarantineVerify: "0"},
		{EnvReplayMaxBatches: "99999999"}} {
		var name string
		for k := range bad {
			name = k
		}
		if _, err := ConfigFromEnv(env(bad)); err == nil || !strings.Contains(err.Error(), name) {
			t.Fatalf("%v: err = %v", bad, err)
		}
	}
}
