package kvevents

import (
	"fmt"
	"strconv"
	"time"
)

// Environment variables ConfigFromEnv reads.
const (
	EnvReplayPortOffset = "LLB_KV_REPLAY_PORT_OFFSET"
	EnvTRTPollMinMS     = "LOXILB_KV_TRTLLM_POLL_MIN_MS"
	EnvTRTPollMaxMS     = "LOXILB_KV_TRTLLM_POLL_MAX_MS"
)

// ConfigFromEnv builds a Config from the daemon's environment, read through
// getenv (os.Getenv in the daemon, a map in tests):
//
//   - LLB_KV_REPLAY_PORT_OFFSET: 0..65535, default 1000; 0 disables replay.
//   - LOXILB_KV_TRTLLM_POLL_MIN_MS / _MAX_MS: 1..10000, defaults 5 and 20;
//     the maximum is raised to the minimum when lower.
//
// An unparsable or out-of-range value is an error naming the variable, so a
// typo does not silently fall back to a default.
func ConfigFromEnv(getenv func(string) string) (Config, error) {
	cfg := Config{ReplayPortOffset: DefaultReplayPortOffset, TRTPollMin: 5 * time.Millisecond, TRTPollMax: 20 * time.Millisecond}
	num := func(name string, lo, hi int, dst func(int)) error {
		v := getenv(name)
		if v == "" {
			return nil
		}
		n, err := strconv.Atoi(v)
		if err != nil || n < lo || n > hi {
			return fmt.Errorf("%s=%q: want an integer in %d..%d", name, v, lo, hi)
		}
		dst(n)
		return nil
	}
	if err := num(EnvReplayPortOffset, 0, 65535, func(n int) { cfg.ReplayPortOffset = n }); err != nil {
		return Config{}, err
	}
	if err := num(EnvTRTPollMinMS, 1, 10000, func(n int) { cfg.TRTPollMin = time.Duration(n) * time.Millisecond }); err != nil {
		return Config{}, err
	}
	if err := num(EnvTRTPollMaxMS, 1, 10000, func(n int) { cfg.TRTPollMax = time.Duration(n) * time.Millisecond }); err != nil {
		return Config{}, err
	}
	if cfg.TRTPollMax < cfg.TRTPollMin {
		cfg.TRTPollMax = cfg.TRTPollMin
	}
	return cfg, nil
}
