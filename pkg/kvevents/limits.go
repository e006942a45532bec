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
	EnvMaxMessageBytes  = "LOXILB_KV_MAX_MESSAGE_BYTES"
	EnvMaxMessageFrames = "LOXILB_KV_MAX_MESSAGE_FRAMES"
	EnvMaxBatchEvents   = "LOXILB_KV_MAX_BATCH_EVENTS"
	EnvMaxBatchHashes   = "LOXILB_KV_MAX_BATCH_HASHES"
	EnvMaxBatchTokens   = "LOXILB_KV_MAX_BATCH_TOKENS"
	EnvTRTMaxHeaderB    = "LOXILB_KV_TRTLLM_MAX_HEADER_BYTES"
	EnvQuarantineVerify = "LOXILB_KV_QUARANTINE_VERIFY_BLOCKS"
	EnvReplayMaxBatches = "LOXILB_KV_REPLAY_MAX_BATCHES"
)

// Defaults and ranges of the input limits. A ZMQ message or a TensorRT-LLM
// drain body larger than MaxMessageBytes is refused before it is buffered;
// a batch announcing more events, block hashes or token ids than the batch
// limits is refused before they are decoded, so a peer cannot make the
// gateway hold much more than the bytes it sent.
const (
	DefaultMaxMessageBytes  = 16 << 20
	DefaultMaxMessageFrames = 16
	DefaultMaxBatchEvents   = 1 << 16
	DefaultMaxBatchHashes   = 1 << 20
	DefaultMaxBatchTokens   = 1 << 22
	DefaultTRTMaxHeaderB    = 64 << 10
	// DefaultQuarantineVerifyBlocks is how many consecutive verified
	// blocks lift the quarantine of an endpoint whose publisher sent
	// blocks that fail attestation.
	DefaultQuarantineVerifyBlocks = 64
	// DefaultReplayMaxBatches bounds the batches of one replay exchange.
	DefaultReplayMaxBatches = 1 << 16
)

// ConfigFromEnv builds a Config from the daemon's environment, read through
// getenv (os.Getenv in the daemon, a map in tests):
//
//   - LLB_KV_REPLAY_PORT_OFFSET: 0..65535, default 1000; 0 disables replay.
//   - LOXILB_KV_TRTLLM_POLL_MIN_MS / _MAX_MS: 1..10000, defaults 5 and 20;
//     the maximum is raised to the minimum when lower.
//   - LOXILB_KV_MAX_MESSAGE_BYTES: 4096..1073741824, default 16 MiB: one
//     ZMQ message (all frames) or one TensorRT-LLM drain body.
//   - LOXILB_KV_MAX_MESSAGE_FRAMES: 4..1024, default 16: frames of one ZMQ
//     message (the engines send 3, replay replies 4 or 5).
//   - LOXILB_KV_MAX_BATCH_EVENTS: 1..16777216, default 65536: events of one
//     batch (msgpack EventBatch or drain body).
//   - LOXILB_KV_MAX_BATCH_HASHES: 1..268435456, default 1048576: block
//     hashes of one batch, all events together.
//   - LOXILB_KV_MAX_BATCH_TOKENS: 1..268435456, default 4194304: token ids
//     of one batch, all events together.
//   - LOXILB_KV_TRTLLM_MAX_HEADER_BYTES: 1024..1048576, default 64 KiB: the
//     response headers of one TensorRT-LLM /kv_cache_events or
//     /server_info exchange.
//   - LOXILB_KV_QUARANTINE_VERIFY_BLOCKS: 1..1048576, default 64:
//     consecutive verified blocks that lift an endpoint's quarantine.
//   - LOXILB_KV_REPLAY_MAX_BATCHES: 1..16777216, default 65536: batches one
//     replay exchange may return.
//
// An unparsable or out-of-range value is an error naming the variable, so a
// typo does not silently fall back to a default.
func ConfigFromEnv(getenv func(string) string) (Config, error) {
	cfg := Config{ReplayPortOffset: DefaultReplayPortOffset, TRTPollMin: 5 * time.Millisecond, TRTPollMax: 20 * time.Millisecond,
		MaxMessageBytes: DefaultMaxMessageBytes, MaxMessageFrames: DefaultMaxMessageFrames,
		MaxBatchEvents: DefaultMaxBatchEvents, MaxBatchHashes: DefaultMaxBatchHashes, MaxBatchTokens: DefaultMaxBatchTokens,
		TRTMaxHeaderBytes: DefaultTRTMaxHeaderB, QuarantineVerifyBlocks: DefaultQuarantineVerifyBlocks,
		ReplayMaxBatches: DefaultReplayMaxBatches}
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
	limits := []struct {
		name   string
		lo, hi int
		dst    *int
	}{
		{EnvMaxMessageBytes, 4096, 1 << 30, &cfg.MaxMessageBytes},
		{EnvMaxMessageFrames, 4, 1024, &cfg.MaxMessageFrames},
		{EnvMaxBatchEvents, 1, 1 << 24, &cfg.MaxBatchEvents},
		{EnvMaxBatchHashes, 1, 1 << 28, &cfg.MaxBatchHashes},
		{EnvMaxBatchTokens, 1, 1 << 28, &cfg.MaxBatchTokens},
		{EnvTRTMaxHeaderB, 1024, 1 << 20, &cfg.TRTMaxHeaderBytes},
		{EnvQuarantineVerify, 1, 1 << 20, &cfg.QuarantineVerifyBlocks},
		{EnvReplayMaxBatches, 1, 1 << 24, &cfg.ReplayMaxBatches},
	}
	for _, l := range limits {
		if err := num(l.name, l.lo, l.hi, func(n int) { *l.dst = n }); err != nil {
			return Config{}, err
		}
	}
	if cfg.TRTPollMax < cfg.TRTPollMin {
		cfg.TRTPollMax = cfg.TRTPollMin
	}
	return cfg, nil
}
