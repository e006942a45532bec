package dispatch

import (
	"fmt"
	"time"
)

// Limits of the configuration.
const (
	// MaxQueueDepthPerEP bounds LLB_PD_QUEUE_DEPTH_PER_EP, as loxilb does.
	MaxQueueDepthPerEP = 64
	// DefaultBootstrapPort is SGLang's --disaggregation-bootstrap-port
	// default, used when a rule's pdBootstrapPort is 0.
	DefaultBootstrapPort = 8998
)

// Config holds the process-wide P/D settings. Zero values take the defaults
// documented on each field (see WithDefaults). The daemon reads the LLB_PD_*
// variables named on the fields from its settings table (cmd/loxilb).
type Config struct {
	// PrefillTimeout bounds a whole prefill (or context) leg: connect,
	// compute and the complete response. LLB_PD_PREFILL_TIMEOUT_SEC,
	// default 30s.
	PrefillTimeout time.Duration
	// DecodeFirstByteTimeout bounds the time from sending a decode leg to
	// its first response body byte. LLB_PD_DECODE_TIMEOUT_SEC, default 60s.
	DecodeFirstByteTimeout time.Duration
	// DecodeIdleTimeout bounds the silence between two reads of a decode
	// response once it started. LLB_PD_DECODE_IDLE_SEC, default 60s.
	DecodeIdleTimeout time.Duration
	// DialTimeout bounds one connect (and TLS handshake) to an endpoint;
	// it replaces the proxy's own for the legs. Default 3s.
	DialTimeout time.Duration

	// MaxInflightPerEP caps concurrent legs per endpoint; 0 disables
	// admission control. LLB_PD_MAX_INFLIGHT_PER_EP.
	MaxInflightPerEP int
	// QueueDepthPerEP is how many requests may wait for a slot of one
	// endpoint when it is at its cap; beyond it a request is shed with 429.
	// LLB_PD_QUEUE_DEPTH_PER_EP, 0..64, default 16; a negative value (what
	// the daemon makes of an explicit 0) means no waiting at all.
	QueueDepthPerEP int
	// MaxPark is how long a request waits for a slot before it is shed
	// with 503. LLB_PD_MAX_PARK_SEC, default 5s.
	MaxPark time.Duration
	// MaxTotalInflight caps concurrent P/D requests of the process; 0 is
	// unlimited. LLB_PD_MAX_TOTAL_INFLIGHT.
	MaxTotalInflight int
	// RetryAfter is the Retry-After value sent with 429 and 503 sheds.
	// Default 1s (rounded up to whole seconds on the wire).
	RetryAfter time.Duration

	// MaxParamsBytes caps the transfer parameters taken from a prefill
	// response (vLLM kv_transfer_params, TensorRT-LLM
	// disaggregated_params), and MaxPrefillBody the whole prefill body.
	// Defaults 64 KiB and 4 MiB.
	MaxParamsBytes int
	MaxPrefillBody int64

	// SessionTTL is how long a session keeps its prefill and decode
	// endpoints after its last request; SessionMax bounds the table.
	// Defaults 300s and 65536.
	SessionTTL time.Duration
	SessionMax int
	// TrieMaxKeys bounds the routing-history prefix index per service.
	// Default 262144 block keys.
	TrieMaxKeys int
	// TrieMinPercent is the share of the request's blocks the history must
	// match for the prefix tier to decide (loxilb's pd_cache_threshold).
	// Default 20.
	TrieMinPercent int
	// BalanceAbs lets an affinity tier (session, prefix history) keep its
	// endpoint only while that endpoint has at most this many more legs in
	// flight than the least loaded one (loxilb's pd_balance_abs_threshold).
	// Default 3; negative disables the guard.
	BalanceAbs int
	// PromptChunkBytes is the chunk size of the prompt-prefix hash used for
	// the prefix history when the gateway supplies no block keys.
	// Default 64.
	PromptChunkBytes int

	// The legs' connections, TLS settings (security 2), response header
	// limit and pool size are the proxy's: see Request.Legs.
}

// WithDefaults returns c with unset fields defaulted.
func (c Config) WithDefaults() Config {
	def := func(d *time.Duration, v time.Duration) {
		if *d == 0 {
			*d = v
		}
	}
	def(&c.PrefillTimeout, 30*time.Second)
	def(&c.DecodeFirstByteTimeout, 60*time.Second)
	def(&c.DecodeIdleTimeout, 60*time.Second)
	def(&c.DialTimeout, 3*time.Second)
	def(&c.MaxPark, 5*time.Second)
	def(&c.RetryAfter, time.Second)
	def(&c.SessionTTL, 300*time.Second)
	switch {
	case c.QueueDepthPerEP == 0:
		c.QueueDepthPerEP = 16
	case c.QueueDepthPerEP < 0:
		c.QueueDepthPerEP = 0 // explicitly no waiting
	}
	if c.MaxParamsBytes == 0 {
		c.MaxParamsBytes = 64 << 10
	}
	if c.MaxPrefillBody == 0 {
		c.MaxPrefillBody = 4 << 20
	}
	if c.SessionMax == 0 {
		c.SessionMax = 65536
	}
	if c.TrieMaxKeys == 0 {
		c.TrieMaxKeys = 262144
	}
	if c.TrieMinPercent == 0 {
		c.TrieMinPercent = 20
	}
	if c.BalanceAbs == 0 {
		c.BalanceAbs = 3
	}
	if c.PromptChunkBytes == 0 {
		c.PromptChunkBytes = 64
	}
	return c
}

// Validate reports the first invalid field of a defaulted config.
func (c Config) Validate() error {
	switch {
	case c.PrefillTimeout < 0 || c.DecodeFirstByteTimeout < 0 || c.DecodeIdleTimeout < 0 || c.DialTimeout < 0 || c.MaxPark < 0:
		return fmt.Errorf("P/D timeouts must not be negative")
	case c.MaxInflightPerEP < 0:
		return fmt.Errorf("LLB_PD_MAX_INFLIGHT_PER_EP %d: must be >= 0", c.MaxInflightPerEP)
	case c.QueueDepthPerEP < 0 || c.QueueDepthPerEP > MaxQueueDepthPerEP:
		return fmt.Errorf("LLB_PD_QUEUE_DEPTH_PER_EP %d: must be within 0..%d", c.QueueDepthPerEP, MaxQueueDepthPerEP)
	case c.MaxTotalInflight < 0:
		return fmt.Errorf("LLB_PD_MAX_TOTAL_INFLIGHT %d: must be >= 0", c.MaxTotalInflight)
	case c.MaxParamsBytes < 2 || c.MaxPrefillBody < int64(c.MaxParamsBytes):
		return fmt.Errorf("params cap %d / prefill body cap %d: need 2 <= params <= body", c.MaxParamsBytes, c.MaxPrefillBody)
	case c.SessionMax < 1 || c.TrieMaxKeys < 1:
		return fmt.Errorf("session table %d / prefix index %d: must be positive", c.SessionMax, c.TrieMaxKeys)
	case c.TrieMinPercent < 0 || c.TrieMinPercent > 100:
		return fmt.Errorf("prefix threshold %d%%: must be within 0..100", c.TrieMinPercent)
	case c.PromptChunkBytes < 1:
		return fmt.Errorf("prompt chunk %d bytes: must be positive", c.PromptChunkBytes)
	}
	return nil
}
