package main

import (
	"flag"
	"io"
	"strings"
	"testing"
	"time"

	"github.com/loxilb-llm/loxilb/pkg/dispatch"
	"github.com/loxilb-llm/loxilb/pkg/gateway"
	"github.com/loxilb-llm/loxilb/pkg/router"
)

func envOf(m map[string]string) func(string) (string, bool) {
	return func(k string) (string, bool) { v, ok := m[k]; return v, ok }
}

// TestSettingsTableWellFormed: every row is documented and reachable, no
// name is used twice, and every default is inside its own range (the
// unset sentinels excepted), so a default can never be refused.
func TestSettingsTableWellFormed(t *testing.T) {
	c := &config{}
	seen := map[string]bool{}
	for _, s := range c.settings() {
		if s.flag == "" && s.env == "" || s.meaning == "" || s.table == "" || s.val == nil {
			t.Errorf("incomplete row %+v", s)
		}
		for _, n := range []string{"--" + s.flag, s.env} {
			if n != "--" && n != "" && seen[n] {
				t.Errorf("%s appears twice", n)
			}
			seen[n] = true
		}
		if s.env != "" && !strings.HasPrefix(s.env, "LLB_") && !strings.HasPrefix(s.env, "LOXILB_") {
			t.Errorf("%s: environment names start with LLB_ or LOXILB_", s.env)
		}
		if err := s.val.check(); err != nil && s.def != "unset" {
			t.Errorf("%s: default %s refused: %v", s.name(), s.val, err)
		}
	}
}

// TestSettingsFromEnvironment: each package's settings arrive in its typed
// configuration, with the sentinels the package expects.
func TestSettingsFromEnvironment(t *testing.T) {
	cfg, err := parseFlags(nil, noEnv, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	if d := router.DefaultConfig(); cfg.router.MinMatchTokens != d.MinMatchTokens || cfg.router.SpillRelief != nil ||
		cfg.router.LoadPenalty != router.LoadPenaltyAdaptive || cfg.router.TierWeightCPU != 0.8 || cfg.router.LoadWeights != d.LoadWeights {
		t.Errorf("router defaults %+v", cfg.router)
	}
	if err := cfg.router.Validate(); err != nil {
		t.Error(err)
	}
	if cfg.kv.ReplayPortOffset != 1000 || cfg.kv.TRTPollMin != 5*time.Millisecond || cfg.kv.TRTPollMax != 20*time.Millisecond || cfg.kv.MaxMessageFrames != 16 {
		t.Errorf("kv defaults %+v", cfg.kv)
	}
	if cfg.gatewayCoalesceWait() != gateway.DefaultCoalesceWait || cfg.prefillSlots != gateway.PrefillAuto || cfg.prefillWait != gateway.DefaultPrefillQueueWait {
		t.Errorf("gateway defaults %v %d %v", cfg.gatewayCoalesceWait(), cfg.prefillSlots, cfg.prefillWait)
	}
	if pd := cfg.dispatchConfig(); pd.WithDefaults() != (dispatch.Config{}).WithDefaults() {
		t.Errorf("P/D defaults differ from the dispatcher's: %+v", pd)
	}
	if cfg.maxBlocks != 1_000_000 || cfg.seed != "" {
		t.Errorf("max blocks %d seed %q", cfg.maxBlocks, cfg.seed)
	}

	cfg, err = parseFlags(nil, envOf(map[string]string{
		"LLB_KV_MIN_MATCH_TOKENS": "0", "LOXILB_KV_SPILL_RELIEF": " ON ", "LOXILB_KV_COLDSTART_SEED_N": "0",
		"LOXILB_KV_ZERO_HIT_N": "7", "LOXILB_KV_MEAN_LOAD_FACTOR": "300", "LOXILB_KV_LOAD_PENALTY": "0", "LOXILB_KV_TIER_WEIGHT_CPU": "0.75",
		"LLB_KV_REPLAY_PORT_OFFSET": "0", "LOXILB_KV_TRTLLM_POLL_MIN_MS": "50", "LOXILB_KV_TRTLLM_POLL_MAX_MS": "10",
		"LOXILB_KV_MAX_MESSAGE_BYTES": "1048576", "LOXILB_KV_MAX_BATCH_TOKENS": "300",
		"LOXILB_KV_COALESCE_WAIT_MS": "0", "LOXILB_KV_PREFILL_SLOTS": "32", "LOXILB_KV_PREFILL_QUEUE_MS": "750",
		"LLB_PD_PREFILL_TIMEOUT_SEC": "2.5", "LLB_PD_MAX_INFLIGHT_PER_EP": "8", "LLB_PD_QUEUE_DEPTH_PER_EP": "0", "LLB_PD_MAX_PARK_SEC": "1",
		"LOXILB_KV_MAX_BLOCKS": "5000", "LLB_KV_NONE_HASH_SEED": "12345",
	}), io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	r := cfg.router
	if r.MinMatchTokens != 0 || r.SpillRelief == nil || !*r.SpillRelief || r.ColdSeedN != 0 || r.ZeroHitN != 7 || r.MeanLoadFactor != 300 ||
		r.LoadPenalty != 0 || r.TierWeightCPU != 0.75 {
		t.Errorf("router %+v", r)
	}
	if k := cfg.kv; k.ReplayPortOffset != 0 || k.TRTPollMin != 50*time.Millisecond || k.TRTPollMax != 10*time.Millisecond ||
		k.MaxMessageBytes != 1<<20 || k.MaxBatchTokens != 300 {
		t.Errorf("kv %+v", k)
	}
	if cfg.gatewayCoalesceWait() >= 0 || cfg.prefillSlots != 32 || cfg.prefillWait != 750*time.Millisecond {
		t.Errorf("gateway %v %d %v", cfg.gatewayCoalesceWait(), cfg.prefillSlots, cfg.prefillWait)
	}
	pd := cfg.dispatchConfig().WithDefaults()
	if pd.PrefillTimeout != 2500*time.Millisecond || pd.MaxInflightPerEP != 8 || pd.QueueDepthPerEP != 0 || pd.MaxPark != time.Second {
		t.Errorf("P/D %+v", pd)
	}
	if err := pd.Validate(); err != nil {
		t.Error(err)
	}
	if v := cfg.ruleSettings().VLLMSeed; cfg.maxBlocks != 5000 || v != "12345" {
		t.Errorf("max blocks %d, seed %q", cfg.maxBlocks, v)
	}

	for _, v := range []string{"0", "false", "off", "no"} {
		cfg, err := parseFlags(nil, envOf(map[string]string{"LOXILB_KV_SPILL_RELIEF": v}), io.Discard)
		if err != nil || cfg.router.SpillRelief == nil || *cfg.router.SpillRelief {
			t.Errorf("spill relief %q: %v", v, err)
		}
	}
	for _, c := range []struct {
		val  string
		want int
	}{{"adaptive", router.LoadPenaltyAdaptive}, {" Adaptive ", router.LoadPenaltyAdaptive}, {"-1", router.LoadPenaltyAdaptive}, {"512", 512}} {
		cfg, err := parseFlags(nil, envOf(map[string]string{"LOXILB_KV_LOAD_PENALTY": c.val}), io.Discard)
		if err != nil || cfg.router.LoadPenalty != c.want {
			t.Errorf("load penalty %q: %v %v", c.val, cfg, err)
		}
	}
	for _, v := range []string{"auto", "AUTO"} {
		if cfg, err := parseFlags(nil, envOf(map[string]string{"LOXILB_KV_PREFILL_SLOTS": v}), io.Discard); err != nil || cfg.prefillSlots != gateway.PrefillAuto {
			t.Errorf("prefill slots %q: %v", v, err)
		}
	}
}

// TestSettingsRefused: a malformed or out-of-range value stops the daemon
// naming the variable, never a silent default.
func TestSettingsRefused(t *testing.T) {
	for _, bad := range []map[string]string{
		{"LLB_KV_MIN_MATCH_TOKENS": "4097"}, {"LLB_KV_MIN_MATCH_TOKENS": "-1"}, {"LLB_KV_MIN_MATCH_TOKENS": "sixteen"},
		{"LOXILB_KV_SPILL_RELIEF": "maybe"}, {"LOXILB_KV_ZERO_HIT_N": "0"}, {"LOXILB_KV_MEAN_LOAD_FACTOR": "99"},
		{"LOXILB_KV_LOAD_PENALTY": "100001"}, {"LOXILB_KV_LOAD_PENALTY": "-2"}, {"LOXILB_KV_LOAD_PENALTY": "auto"},
		{"LOXILB_KV_COLDSTART_SEED_N": "-3"},
		{"LOXILB_KV_TIER_WEIGHT_CPU": "1.5"}, {"LOXILB_KV_TIER_WEIGHT_CPU": "-0.1"}, {"LOXILB_KV_TIER_WEIGHT_CPU": "NaN"}, {"LOXILB_KV_TIER_WEIGHT_CPU": "x"},
		{"LLB_KV_REPLAY_PORT_OFFSET": "-1"}, {"LOXILB_KV_TRTLLM_POLL_MIN_MS": "0"}, {"LOXILB_KV_TRTLLM_POLL_MAX_MS": "fast"},
		{"LOXILB_KV_MAX_MESSAGE_BYTES": "100"}, {"LOXILB_KV_MAX_MESSAGE_BYTES": "2147483648"}, {"LOXILB_KV_MAX_MESSAGE_FRAMES": "3"},
		{"LOXILB_KV_MAX_BATCH_EVENTS": "0"}, {"LOXILB_KV_MAX_BATCH_HASHES": "x"}, {"LOXILB_KV_MAX_BATCH_TOKENS": "-5"},
		{"LOXILB_KV_TRTLLM_MAX_HEADER_BYTES": "10"}, {"LOXILB_KV_QUARANTINE_VERIFY_BLOCKS": "0"}, {"LOXILB_KV_REPLAY_MAX_BATCHES": "99999999"},
		{"LOXILB_KV_COALESCE_WAIT_MS": "-1"}, {"LOXILB_KV_COALESCE_WAIT_MS": "600001"}, {"LOXILB_KV_COALESCE_WAIT_MS": "1.5"},
		{"LOXILB_KV_PREFILL_SLOTS": "-1"}, {"LOXILB_KV_PREFILL_SLOTS": "two"}, {"LOXILB_KV_PREFILL_SLOTS": "5000"},
		{"LOXILB_KV_PREFILL_QUEUE_MS": "0"}, {"LOXILB_KV_PREFILL_QUEUE_MS": "1s"},
		{"LLB_PD_QUEUE_DEPTH_PER_EP": "65"}, {"LLB_PD_MAX_PARK_SEC": "-1"}, {"LLB_PD_MAX_PARK_SEC": "0"},
		{"LLB_PD_PREFILL_TIMEOUT_SEC": "soon"}, {"LLB_PD_MAX_INFLIGHT_PER_EP": "x"},
		{"LOXILB_KV_MAX_BLOCKS": "999"}, {"LOXILB_KV_MAX_BLOCKS": "many"},
		{"LLB_PD_ORIGIN_ERR_THRESHOLD": "1001"},
	} {
		_, err := parseFlags(nil, envOf(bad), io.Discard)
		for k := range bad {
			if err == nil || !strings.Contains(err.Error(), k) {
				t.Errorf("%v: error %v should name %s", bad, err, k)
			}
		}
	}
}

// TestFlagWinsOverEnvironment: the variable is the flag's default.
func TestFlagWinsOverEnvironment(t *testing.T) {
	env := envOf(map[string]string{"LOXILB_OUTLIER_CONSECUTIVE_5XX": "2000"})
	if _, err := parseFlags(nil, env, io.Discard); err == nil || !strings.Contains(err.Error(), "LOXILB_OUTLIER_CONSECUTIVE_5XX") {
		t.Errorf("out-of-range variable: %v", err)
	}
	cfg, err := parseFlags([]string{"--outlier-consecutive-5xx", "7"}, envOf(map[string]string{"LOXILB_OUTLIER_CONSECUTIVE_5XX": "2"}), io.Discard)
	if err != nil || cfg.outlier.ServerErrors != 7 {
		t.Errorf("flag over variable: %v %v", cfg, err)
	}
}

// FuzzSettings: whatever the environment holds, the daemon either refuses
// it or builds configurations its packages accept.
func FuzzSettings(f *testing.F) {
	f.Add("16", "on", "16", "16", "50", "175", "32", "0.8")
	f.Add("-1", "maybe", "x", "", "0", "99999999999999999999", " 7 ", "NaN")
	f.Fuzz(func(t *testing.T, mm, spill, seed, minb, zero, mlf, pen, tier string) {
		env := map[string]string{
			"LLB_KV_MIN_MATCH_TOKENS": mm, "LOXILB_KV_SPILL_RELIEF": spill, "LOXILB_KV_COLDSTART_SEED_N": seed,
			"LOXILB_KV_COLDSTART_MIN_BLOCKS": minb, "LOXILB_KV_ZERO_HIT_N": zero, "LOXILB_KV_MEAN_LOAD_FACTOR": mlf,
			"LOXILB_KV_LOAD_PENALTY": pen, "LOXILB_KV_TIER_WEIGHT_CPU": tier,
		}
		c := &config{}
		if err := load(flag.NewFlagSet("fuzz", flag.ContinueOnError), c.settings(), nil, envOf(env)); err != nil {
			return
		}
		if err := c.router.Validate(); err != nil {
			t.Fatalf("accepted settings the router refuses %+v: %v", c.router, err)
		}
	})
}
