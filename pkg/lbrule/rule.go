package lbrule

import (
	"encoding/json"
	"fmt"
	"net/netip"
	"strconv"
	"strings"
)

// LB modes (serviceArguments.mode), loxilb numbering.
const (
	ModeDNAT       = 0
	ModeOneArm     = 1
	ModeFullNAT    = 2
	ModeDSR        = 3
	ModeFullProxy  = 4
	ModeHostOneArm = 5
)

// Endpoint selectors (serviceArguments.sel), loxilb numbering; 7 is reserved.
const (
	SelRR        = 0
	SelHash      = 1
	SelPriority  = 2
	SelPersist   = 3
	SelLC        = 4
	SelN2        = 5
	SelN3        = 6
	SelCHWBL     = 8
	SelGPUAware  = 9
	SelWRRHash   = 10
	maxSelector  = 10
	reservedSel7 = 7
)

// KV-exact modes (serviceArguments.kvExactMode).
const (
	KVExactOff     = 0
	KVExactPD      = 1 // Tier 1.5 over prefill endpoints of a P/D pool
	KVExactNATS    = 2 // reserved, never implemented
	KVExactSingle  = 3 // role-less pool, every endpoint scored
	maxKVExactMode = 3
)

// Endpoint roles (endpoints[].ep_role).
const (
	RoleNone    = 0
	RolePrefill = 1
	RoleDecode  = 2
)

// Security levels (serviceArguments.security).
const (
	SecurityPlain  = 0 // plaintext on both sides
	SecurityTLS    = 1 // TLS terminated at the proxy, plaintext to endpoints
	SecurityE2ETLS = 2 // TLS terminated, and TLS again to endpoints
)

// Limits of the rule model.
const (
	MaxEndpoints      = 32
	MaxInactiveTimout = 86400
	MaxBlockSize      = 65536
	MaxNameLen        = 128   // name and session_header_name, in bytes
	MaxModelNameLen   = 256   // model_name, in bytes
	MaxProbeTextLen   = 1024  // probereq and proberesp, in bytes
	MaxProbeTimeout   = 86400 // probeTimeout, seconds
	MaxProbeRetries   = 100
)

// ServiceArgs is serviceArguments; JSON keys are spelled exactly as loxilb's API
// (mixed camelCase and snake_case included) so existing bodies work unchanged.
type ServiceArgs struct {
	ExternalIP      string `json:"externalIP"`
	Port            int    `json:"port"`
	Protocol        string `json:"protocol"`
	Mode            int    `json:"mode"`
	Sel             int    `json:"sel"`
	Security        int    `json:"security"`
	Name            string `json:"name,omitempty"`
	Block           int    `json:"block,omitempty"`
	Monitor         bool   `json:"monitor"`
	ProbeType       string `json:"probetype,omitempty"`
	ProbePort       int    `json:"probeport,omitempty"`
	ProbeReq        string `json:"probereq,omitempty"`
	ProbeResp       string `json:"proberesp,omitempty"`
	ProbeTimeout    int    `json:"probeTimeout,omitempty"`
	ProbeRetries    int    `json:"probeRetries,omitempty"`
	InactiveTimeOut int    `json:"inactiveTimeOut,omitempty"`

	// ModelName pins the served model (and so the tokenizer slug) of a
	// mode-4 rule; when empty the proxy takes the model from each request.
	ModelName string `json:"model_name,omitempty"`
	// SessionHeaderName names a request header whose value keeps a client on
	// the same prefill/decode workers (P/D session affinity).
	SessionHeaderName string `json:"session_header_name,omitempty"`

	KVExactMode int    `json:"kvExactMode"`
	KVEngine    string `json:"kvEngineType,omitempty"`
	KVHashAlgo  string `json:"kvHashAlgo,omitempty"`
	KVBlockSize int    `json:"kvBlockSize,omitempty"`
	KVZmqPort   int    `json:"kvZmqPort,omitempty"`
	// KVWarmupSec is accepted and echoed for compatibility but inert: loxilb
	// never arms the warmup timer either, and Tier 1.5 starts as soon as the
	// inventory has blocks. A pointer so an explicit 0 survives normalization.
	KVWarmupSec   *int `json:"kvWarmupSec,omitempty"`
	KVDpRankCount int  `json:"kvDpRankCount,omitempty"`
	// KVParityStrict keeps Tier-1.5 traffic off endpoints whose hash-parity
	// verdict is a mismatch (hash_mismatch, block_size_mismatch,
	// hash_algo_mismatch). nil: the daemon's --kv-parity-strict.
	KVParityStrict *bool `json:"kvParityStrict,omitempty"`
	PDDisagg       bool  `json:"pd_disagg_mode"`
	PDBootstrap    int   `json:"pdBootstrapPort,omitempty"`
	// KVModelProfile names a built-in model profile: how the engine renders
	// prompts beyond its defaults (see profiles.go).
	KVModelProfile string `json:"kvModelProfile,omitempty"`

	// Consistent-hash tuning (sel 8 chwbl, sel 10 wrr-hash); see chwbl.go.
	ChwblPrefixHashLevel int  `json:"chwbl_prefix_hash_level,omitempty"`
	ChwblPrefixHashFlags int  `json:"chwbl_prefix_hash_flags,omitempty"`
	ChwblMeanLoadFactor  int  `json:"chwbl_mean_load_factor,omitempty"`
	ChwblReplication     int  `json:"chwbl_replication,omitempty"`
	ChwblEnableCacheSalt bool `json:"chwbl_enable_cache_salt,omitempty"`

	// loxilb fields this gateway accepts, validates and echoes but does not
	// act on; Inert lists the ones a rule sets (see compat.go).
	PDCacheAware          bool `json:"pd_cache_aware_mode,omitempty"`
	PDSessionTTLSec       int  `json:"pd_session_ttl_sec,omitempty"`
	PDCacheThreshold      *int `json:"pd_cache_threshold,omitempty"`
	PDBalanceAbsThreshold *int `json:"pd_balance_abs_threshold,omitempty"`
	SSEMode               bool `json:"sse_mode,omitempty"`
	// MaxStreamDurationSec caps an event stream's length (honoured; 0 is
	// loxilb's 24 h cap).
	MaxStreamDurationSec int           `json:"max_stream_duration_sec,omitempty"`
	MTLSFrontend         *MTLSFrontend `json:"mtls_frontend,omitempty"`
	MTLSBackend          *MTLSBackend  `json:"mtls_backend,omitempty"`
}

// Endpoint is one entry of endpoints[].
type Endpoint struct {
	IP       string `json:"endpointIP"`
	Port     int    `json:"targetPort"`
	Weight   int    `json:"weight"`
	Role     int    `json:"ep_role"`
	NixlPort int    `json:"nixl_port,omitempty"`
	// Octavia health-monitor fields (see compat.go): accepted, validated,
	// echoed; the rule's probe settings are what the prober uses.
	MonitorAddress string `json:"monitorAddress,omitempty"`
	HTTPMethod     string `json:"httpMethod,omitempty"`
	URLPath        string `json:"urlPath,omitempty"`
	ExpectedCodes  string `json:"expectedCodes,omitempty"`
	HTTPVersion    string `json:"httpVersion,omitempty"`
	DomainName     string `json:"domainName,omitempty"`
	// State is read-back only ("active"/"inactive"); ignored on input so a
	// read-back body can be posted again.
	State string `json:"state,omitempty"`
	// Draining is read-back only, like State: the endpoint is in
	// maintenance (it takes no new requests or flows; those in flight
	// finish). Set through the drain API, never by a create body.
	Draining bool `json:"draining,omitempty"`
	// KVParity is read-back only: the endpoint's hash-parity verdict
	// (ok, unverified, hash_mismatch, ...) on KV-exact rules.
	KVParity string `json:"kvParity,omitempty"`
	// KVExcluded is read-back only: strict attestation keeps Tier-1.5
	// traffic off the endpoint (its verdict is a mismatch).
	KVExcluded bool `json:"kvExcluded,omitempty"`
}

// Addr renders the endpoint as host:port ("[v6]:port" for IPv6), the
// form the drain API and the store name it by.
func (e Endpoint) Addr() string { return netipJoin(e.IP, e.Port) }

// Rule is one load-balancer rule: the body of POST /config/loadbalancer.
type Rule struct {
	// ServiceID is read-back only (the numeric service_id of the inventory
	// API and metric labels); ignored on input so read-back bodies re-post.
	ServiceID uint32      `json:"serviceID,omitempty"`
	Service   ServiceArgs `json:"serviceArguments"`
	Endpoints []Endpoint  `json:"endpoints"`
	// Status is read-back only, like ServiceID: whether the rule is in
	// effect. Ignored on input.
	Status *Status `json:"ruleStatus,omitempty"`
	// CreateBody is read-back only, like ServiceID: the rule's last applied
	// create body, byte for byte (GET /config/loadbalancer/all?body=true).
	// Ignored on input.
	CreateBody json.RawMessage `json:"createBody,omitempty"`
}

// Status is a rule's state as the daemon reports it: applied, degraded
// (serving without a side stage: KV events, health probes) or failed (not
// serving: a stage could not apply it, or the stored rule is invalid or a
// duplicate), with a stable reason code.
type Status struct {
	State      string `json:"state"`
	ReasonCode string `json:"reason_code,omitempty"`
	Reason     string `json:"reason,omitempty"`
	Attempts   int    `json:"attempts,omitempty"`   // failed apply attempts in a row
	NextRetry  string `json:"next_retry,omitempty"` // RFC 3339; absent when not retried
}

// Key identifies a rule the way loxilb does: VIP, port, protocol and mark.
type Key struct {
	IP    string
	Port  int
	Proto string
	Block int
}

// String renders the key as ip:port/proto (with the mark when set).
func (k Key) String() string {
	s := netipJoin(k.IP, k.Port) + "/" + k.Proto
	if k.Block != 0 {
		s += fmt.Sprintf("#%d", k.Block)
	}
	return s
}

func netipJoin(ip string, port int) string {
	if a, err := netip.ParseAddr(ip); err == nil && a.Is6() {
		return "[" + ip + "]:" + strconv.Itoa(port)
	}
	return ip + ":" + strconv.Itoa(port)
}

// Key returns the rule's identity. Call it on a normalized rule.
func (r *Rule) Key() Key {
	return Key{IP: canonicalIP(r.Service.ExternalIP), Port: r.Service.Port, Proto: strings.ToLower(r.Service.Protocol), Block: r.Service.Block}
}

func canonicalIP(s string) string {
	if a, err := netip.ParseAddr(s); err == nil {
		return a.Unmap().String()
	}
	return s
}

// Engine returns the effective engine name (the default when omitted).
func (r *Rule) Engine() string {
	if r.Service.KVEngine == "" {
		return "vllm"
	}
	return r.Service.KVEngine
}

// WarmupSec returns the (inert) warmup value.
func (r *Rule) WarmupSec() int {
	if r.Service.KVWarmupSec == nil {
		return 30
	}
	return *r.Service.KVWarmupSec
}

// Clone returns a deep copy, so callers can keep a rule while others edit theirs.
func (r *Rule) Clone() *Rule {
	c := *r
	c.Endpoints = append([]Endpoint(nil), r.Endpoints...)
	if r.Service.KVWarmupSec != nil {
		v := *r.Service.KVWarmupSec
		c.Service.KVWarmupSec = &v
	}
	c.Service.KVParityStrict = clonePtr(r.Service.KVParityStrict)
	c.Service.PDCacheThreshold = clonePtr(r.Service.PDCacheThreshold)
	c.Service.PDBalanceAbsThreshold = clonePtr(r.Service.PDBalanceAbsThreshold)
	if r.Service.MTLSFrontend != nil {
		v := *r.Service.MTLSFrontend
		c.Service.MTLSFrontend = &v
	}
	if r.Service.MTLSBackend != nil {
		v := *r.Service.MTLSBackend
		c.Service.MTLSBackend = &v
	}
	return &c
}

// SubscribedEndpoints lists the endpoint indexes whose KV events the gateway
// consumes: prefill endpoints for kvExactMode 1, every endpoint for 3.
func (r *Rule) SubscribedEndpoints() []int {
	var out []int
	for i, ep := range r.Endpoints {
		switch r.Service.KVExactMode {
		case KVExactPD:
			if ep.Role == RolePrefill {
				out = append(out, i)
			}
		case KVExactSingle:
			out = append(out, i)
		}
	}
	return out
}

// ModeName renders a mode the way loxicmd prints it.
func ModeName(m int) string {
	switch m {
	case ModeDNAT:
		return "default"
	case ModeOneArm:
		return "onearm"
	case ModeFullNAT:
		return "fullnat"
	case ModeDSR:
		return "dsr"
	case ModeFullProxy:
		return "fullproxy"
	case ModeHostOneArm:
		return "hostonearm"
	}
	return strconv.Itoa(m)
}

// ParseMode maps a loxicmd --mode name (or number) to a mode.
func ParseMode(s string) (int, error) {
	switch strings.ToLower(s) {
	case "", "default", "dnat", "0":
		return ModeDNAT, nil
	case "onearm", "1":
		return ModeOneArm, nil
	case "fullnat", "2":
		return ModeFullNAT, nil
	case "dsr", "3":
		return ModeDSR, nil
	case "fullproxy", "4":
		return ModeFullProxy, nil
	case "hostonearm", "5":
		return ModeHostOneArm, nil
	}
	return 0, fmt.Errorf("unknown mode %q (want default, onearm, fullnat, dsr, fullproxy or hostonearm)", s)
}

var selNames = map[int]string{SelRR: "rr", SelHash: "hash", SelPriority: "priority", SelPersist: "persist",
	SelLC: "lc", SelN2: "n2", SelN3: "n3", SelCHWBL: "chwbl", SelGPUAware: "gpuaware", SelWRRHash: "wrr-hash"}

// SelName renders a selector the way loxicmd prints it.
func SelName(s int) string {
	if n, ok := selNames[s]; ok {
		return n
	}
	return strconv.Itoa(s)
}

// ParseSel maps a loxicmd --select name (or number) to a selector.
func ParseSel(s string) (int, error) {
	switch strings.ToLower(s) {
	case "", "rr", "roundrobin":
		return SelRR, nil
	case "gpu-aware":
		return SelGPUAware, nil
	case "chwbl-wrr", "wrrhash":
		return SelWRRHash, nil
	}
	for n, name := range selNames {
		if name == strings.ToLower(s) {
			return n, nil
		}
	}
	if n, err := strconv.Atoi(s); err == nil && n >= 0 && n <= maxSelector && n != reservedSel7 {
		return n, nil
	}
	return 0, fmt.Errorf("unknown selector %q (want rr, hash, priority, persist, lc, n2, n3, chwbl, gpuaware or wrr-hash)", s)
}

// RoleName renders an endpoint role.
func RoleName(r int) string {
	switch r {
	case RolePrefill:
		return "prefill"
	case RoleDecode:
		return "decode"
	}
	return "normal"
}

// ParseRole maps a loxicmd --ep-role name to a role.
func ParseRole(s string) (int, error) {
	switch strings.ToLower(strings.TrimSpace(s)) {
	case "", "normal", "none", "0":
		return RoleNone, nil
	case "prefill", "p", "1":
		return RolePrefill, nil
	case "decode", "d", "2":
		return RoleDecode, nil
	}
	return 0, fmt.Errorf("unknown endpoint role %q (want normal, prefill or decode)", s)
}
