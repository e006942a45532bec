package enginesim

import (
	"fmt"
	"time"
)

// Engines the emulator can impersonate.
const (
	EngineVLLM     = "vllm"
	EngineSGLang   = "sglang"
	EngineTRTLLM   = "trtllm"
	EngineLlamaCpp = "llamacpp"
)

// Roles of an engine in prefill/decode disaggregation.
const (
	RoleBoth    = "both"
	RolePrefill = "prefill"
	RoleDecode  = "decode"
)

// Replay reply formats.
const (
	// ReplayTopic is current vLLM: [identity, "", topic, seq, payload] and
	// the end marker [identity, "", "", 0xff*8, ""].
	ReplayTopic = "topic"
	// ReplayLegacy is older vLLM and SGLang: [identity, "", seq, payload]
	// and the end marker [identity, "", 0xff*8, ""].
	ReplayLegacy = "legacy"
)

// Config describes one emulated engine. Zero values take the defaults listed
// on each field (see Defaults).
type Config struct {
	Engine string // vllm (default), sglang, trtllm, llamacpp
	Role   string // both (default), prefill, decode
	// Listen is the HTTP address; "127.0.0.1:0" (the default) picks a free port.
	Listen string
	// AdvertiseHost is the host the engine names in P/D parameters
	// (remote_host, the context server address). Default: the listen host,
	// or 127.0.0.1 when that is a wildcard.
	AdvertiseHost string
	Model         string // served model name, default "sim-model"
	// LoRAModules are adapter names served besides Model (vLLM). A request
	// naming one gets that LoRA's name in its block hashes and events.
	LoRAModules []string
	MaxModelLen int // default 32768

	BlockSize      int // tokens per block/page; default 16 (TensorRT-LLM: 32)
	CapacityBlocks int // KV pool size in blocks per rank; default 4096
	// CPUOffloadBlocks is a host-memory tier per rank, in blocks (0, the
	// default, has none). A block evicted from the GPU pool moves there
	// and is published as BlockRemoved "GPU" then BlockStored "CPU", as
	// vLLM's CPU offloading connector does; the tier's own LRU evictions
	// are BlockRemoved "CPU". The emulator publishes the tier but serves
	// prefix hits from the GPU pool only.
	CPUOffloadBlocks int

	// ZMQBind is the host the PUB and ROUTER sockets bind, default 127.0.0.1.
	ZMQBind string
	// ZMQPort is the PUB port of rank 0; rank r binds ZMQPort+r. 0 picks a
	// free port per rank; -1 disables ZMQ events. Ignored for trtllm and
	// llamacpp.
	ZMQPort int
	// ReplayPort is the ROUTER port of rank 0 (rank r: ReplayPort+r). 0 means
	// ZMQPort+1000, or a free port when ZMQPort is 0; -1 disables replay.
	ReplayPort   int
	DPRanks      int    // data-parallel ranks, each with its own cache and publisher; default 1
	Topic        string // ZMQ topic frame, default ""
	BufferSteps  int    // replay buffer in batches, default 10000
	ReplayFormat string // topic (vLLM default) or legacy (SGLang default)

	HashAlgo string // default per engine: sha256_cbor, sha256_sglang, blockhash_trtllm
	// Seed is vLLM's PYTHONHASHSEED. Empty: "vllm-none-hash" for sha256_cbor,
	// random for xxhash_cbor, as current vLLM does.
	Seed string
	// BytesBlockHashes publishes vLLM hashes as raw digests (the engine's
	// VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0) instead of u64.
	BytesBlockHashes bool
	// EventEncoding is map or array; default map for vLLM, array for SGLang.
	EventEncoding string
	// SGLangPartialPages caches and publishes a prompt's trailing partial
	// page (block_size < page size) as SGLang does. It never matches a
	// full-page lookup; off by default so inventories count full pages.
	SGLangPartialPages bool

	PrefillUsPerToken float64 // prefill cost per uncached prompt token, default 50
	DecodeUsPerToken  float64 // decode cost per output token, default 20000
	// DecodeUsPerActiveBlock adds a per-step cost for every KV block pinned
	// by running requests, so decode slows as the batch grows. Default 0.
	DecodeUsPerActiveBlock float64
	MaxRunning             int     // concurrent sequences, default 32
	MaxQueue               int     // waiting requests before 503; 0 means unbounded
	TimeScale              float64 // multiplies every modelled delay; 0 disables delays
	TimeScaleSet           bool    // TimeScale was given (0 is meaningful)
	BootstrapPort          int     // SGLang prefill bootstrap port; 0 picks a free port
	// NIXLSidePort is the NIXL side channel of a vLLM prefill engine
	// (vLLM's VLLM_NIXL_SIDE_CHANNEL_PORT, 5600 there): transfers are
	// claimed on their own listener at this port and remote_port names it,
	// so a gateway that sends the decode leg to the HTTP port fails the
	// transfer. 0 (the default) claims on the HTTP port; -1 picks a free
	// port.
	NIXLSidePort   int
	PDTimeout      time.Duration // how long a decode leg waits for its prefill, default 30s
	TRTEventBuffer int           // TensorRT-LLM event buffer (event_buffer_max_size), default 10000
	RandSeed       uint64        // seeds fault probabilities

	Faults Faults // faults active from the start
}

// Defaults returns cfg with every unset field given its default.
func (c Config) Defaults() Config {
	if c.Engine == "" {
		c.Engine = EngineVLLM
	}
	if c.Role == "" {
		c.Role = RoleBoth
	}
	if c.Listen == "" {
		c.Listen = "127.0.0.1:0"
	}
	if c.Model == "" {
		c.Model = "sim-model"
	}
	if c.MaxModelLen == 0 {
		c.MaxModelLen = 32768
	}
	if c.BlockSize == 0 {
		c.BlockSize = 16
		if c.Engine == EngineTRTLLM {
			c.BlockSize = 32
		}
	}
	if c.CapacityBlocks == 0 {
		c.CapacityBlocks = 4096
	}
	if c.ZMQBind == "" {
		c.ZMQBind = "127.0.0.1"
	}
	if c.DPRanks == 0 {
		c.DPRanks = 1
	}
	if c.BufferSteps == 0 {
		c.BufferSteps = 10000
	}
	if c.ReplayFormat == "" {
		c.ReplayFormat = ReplayTopic
		if c.Engine == EngineSGLang {
			c.ReplayFormat = ReplayLegacy
		}
	}
	if c.HashAlgo == "" {
		c.HashAlgo = defaultAlgo(c.Engine)
	}
	if c.EventEncoding == "" {
		c.EventEncoding = EncodingMap
		if c.Engine == EngineSGLang {
			c.EventEncoding = EncodingArray
		}
	}
	if c.PrefillUsPerToken == 0 {
		c.PrefillUsPerToken = 50
	}
	if c.DecodeUsPerToken == 0 {
		c.DecodeUsPerToken = 20000
	}
	if c.MaxRunning == 0 {
		c.MaxRunning = 32
	}
	if !c.TimeScaleSet && c.TimeScale == 0 {
		c.TimeScale = 1
	}
	if c.PDTimeout == 0 {
		c.PDTimeout = 30 * time.Second
	}
	if c.TRTEventBuffer == 0 {
		c.TRTEventBuffer = 10000
	}
	return c
}

// Validate reports the first invalid field of a defaulted config.
func (c Config) Validate() error {
	switch c.Engine {
	case EngineVLLM, EngineSGLang, EngineTRTLLM, EngineLlamaCpp:
	default:
		return fmt.Errorf("engine %q: want vllm, sglang, trtllm or llamacpp", c.Engine)
	}
	switch c.Role {
	case RoleBoth, RolePrefill, RoleDecode:
	default:
		return fmt.Errorf("role %q: want both, prefill or decode", c.Role)
	}
	if c.Engine == EngineLlamaCpp && c.Role != RoleBoth {
		return fmt.Errorf("role %q: llama.cpp has no prefill/decode disaggregation", c.Role)
	}
	if c.BlockSize <= 0 || c.BlockSize > 4096 {
		return fmt.Errorf("block size %d: must be within 1..4096", c.BlockSize)
	}
	if c.CPUOffloadBlocks < 0 {
		return fmt.Errorf("cpu offload %d blocks: must not be negative", c.CPUOffloadBlocks)
	}
	if c.CapacityBlocks <= 0 {
		return fmt.Errorf("capacity %d blocks: must be positive", c.CapacityBlocks)
	}
	if c.DPRanks < 1 || c.DPRanks > 64 {
		return fmt.Errorf("dp ranks %d: must be within 1..64", c.DPRanks)
	}
	if c.ZMQPort < -1 || c.ZMQPort > 65535 || c.ReplayPort < -1 || c.ReplayPort > 65535 {
		return fmt.Errorf("zmq port %d / replay port %d: must be -1, 0 or a port", c.ZMQPort, c.ReplayPort)
	}
	if c.ZMQPort > 0 && c.ZMQPort+c.DPRanks-1 > 65535 {
		return fmt.Errorf("zmq port %d + %d ranks exceeds 65535", c.ZMQPort, c.DPRanks)
	}
	if c.EventEncoding != EncodingMap && c.EventEncoding != EncodingArray {
		return fmt.Errorf("event encoding %q: want map or array", c.EventEncoding)
	}
	if c.ReplayFormat != ReplayTopic && c.ReplayFormat != ReplayLegacy {
		return fmt.Errorf("replay format %q: want topic or legacy", c.ReplayFormat)
	}
	if c.PrefillUsPerToken < 0 || c.DecodeUsPerToken < 0 || c.DecodeUsPerActiveBlock < 0 || c.TimeScale < 0 {
		return fmt.Errorf("cost model values must not be negative")
	}
	if c.MaxRunning < 1 || c.MaxQueue < 0 {
		return fmt.Errorf("max running %d / max queue %d: need running >= 1 and queue >= 0", c.MaxRunning, c.MaxQueue)
	}
	if c.MaxModelLen < 1 {
		return fmt.Errorf("max model len %d: must be positive", c.MaxModelLen)
	}
	return c.Faults.validate()
}
