package lbrule

import (
	"fmt"
	"net/netip"
	"strings"
	"unicode"
	"unicode/utf8"

	"github.com/loxilb-llm/loxilb/pkg/engine"
)

// SeedEnv is the environment variable holding vLLM's none-hash seed (the
// engine's PYTHONHASHSEED).
const SeedEnv = "LLB_KV_NONE_HASH_SEED"

// Settings are the daemon settings rule validation depends on, read once at
// start by the daemon (validation never reads the environment itself).
type Settings struct {
	// VLLMSeed is SeedEnv's value; empty means unset.
	VLLMSeed string
}

// SeedPrecondition is the one predicate behind both the 412 on vLLM KV-exact
// rules and the kv_exact_vllm capability entry, so the two never disagree.
// It returns nil when the seed is usable.
func SeedPrecondition(s Settings) *RuleError {
	seed := s.VLLMSeed
	if seed == "" {
		return &RuleError{Class: ErrPrecondition, Reason: ReasonSeedUnset,
			Msg: "vllm kvExactMode requires non-empty Gateway " + SeedEnv + " matching engine PYTHONHASHSEED (set it in the daemon's environment and restart; the rule body cannot satisfy this)"}
	}
	if !utf8.ValidString(seed) {
		return &RuleError{Class: ErrPrecondition, Reason: ReasonSeedInvalid,
			Msg: SeedEnv + " is not valid UTF-8: vLLM hashes it as a text string, so no engine can match it (set it to the engine's PYTHONHASHSEED and restart)"}
	}
	if len(seed) > engine.MaxVLLMSeedLen {
		return &RuleError{Class: ErrPrecondition, Reason: ReasonSeedTooLong,
			Msg: fmt.Sprintf("%s must be at most %d bytes for vllm kvExactMode (it is %d bytes)", SeedEnv, engine.MaxVLLMSeedLen, len(seed))}
	}
	return nil
}

// Prepare validates a decoded rule and returns a normalized copy with every
// default applied. All semantic checks of a rule live here.
func Prepare(in *Rule, settings Settings) (*Rule, error) {
	r := in.Clone()
	r.ServiceID, r.Status, r.CreateBody = 0, nil, nil
	if err := validateService(r); err != nil {
		return nil, err
	}
	if err := validateEndpoints(r); err != nil {
		return nil, err
	}
	if err := validateKV(r); err != nil {
		return nil, err
	}
	if err := validateCompat(r); err != nil {
		return nil, err
	}
	normalize(r)
	if r.Engine() == string(engine.VLLM) && (r.Service.KVExactMode == KVExactPD || r.Service.KVExactMode == KVExactSingle) {
		if err := SeedPrecondition(settings); err != nil {
			return nil, err
		}
	}
	return r, nil
}

func validateService(r *Rule) error {
	s := &r.Service
	ip, err := netip.ParseAddr(strings.TrimSpace(s.ExternalIP))
	ip = ip.Unmap()
	if s.ExternalIP == "" {
		return invalid(svcField("externalIP"), "is required (the VIP, e.g. 192.0.2.10)")
	}
	if err != nil {
		return invalid(svcField("externalIP"), "%q is not an IP address", s.ExternalIP)
	}
	// One textual form per address: an IPv4-mapped VIP (::ffff:a.b.c.d) is
	// the IPv4 VIP, so it is found, deleted and conflicted as that.
	s.ExternalIP = ip.Unmap().String()
	s.Protocol = strings.ToLower(s.Protocol)
	switch s.Protocol {
	case "tcp", "udp", "sctp":
		if s.Port < 1 || s.Port > 65535 {
			return invalid(svcField("port"), "%d is out of range 1..65535", s.Port)
		}
	case "icmp":
		if s.Port != 0 {
			return invalid(svcField("port"), "must be 0 for icmp")
		}
	case "":
		return invalid(svcField("protocol"), "is required (tcp, udp, sctp or icmp)")
	default:
		return invalid(svcField("protocol"), "%q is not one of tcp, udp, sctp, icmp", s.Protocol)
	}
	if s.Mode < ModeDNAT || s.Mode > ModeHostOneArm {
		return invalid(svcField("mode"), "%d is out of range 0..5 (0 default, 1 onearm, 2 fullnat, 3 dsr, 4 fullproxy, 5 hostonearm)", s.Mode)
	}
	if s.Mode == ModeHostOneArm && !ip.IsUnspecified() {
		return invalid(svcField("externalIP"), "mode 5 (hostonearm) requires externalIP 0.0.0.0")
	}
	if s.Mode == ModeFullProxy && s.Protocol != "tcp" {
		return invalid(svcField("protocol"), "mode 4 (fullproxy) serves HTTP and needs protocol tcp")
	}
	if s.Sel < 0 || s.Sel > maxSelector {
		return invalid(svcField("sel"), "%d is out of range 0..10", s.Sel)
	}
	if s.Sel == reservedSel7 {
		return invalid(svcField("sel"), "7 is reserved; use 0 rr, 1 hash, 2 priority, 3 persist, 4 lc, 8 chwbl, 9 gpu-aware or 10 wrr-hash")
	}
	switch s.Sel {
	case SelN2, SelGPUAware, SelWRRHash:
		// chwbl (8) is not here: on L4 modes the kernel serves it with a
		// Maglev consistent-hash table.
		if s.Mode != ModeFullProxy {
			return invalid(svcField("sel"), "sel=%s(%d) requires mode=fullproxy (4): no L4 datapath selector exists for it", SelName(s.Sel), s.Sel)
		}
	case SelN3:
		if s.Protocol != "udp" {
			return invalid(svcField("sel"), "sel=n3(6) needs protocol udp (GTP-U)")
		}
	}
	if s.Mode == ModeDSR && s.Sel != SelHash && s.Sel != SelCHWBL {
		return invalid(svcField("sel"), "only hash selection (sel 1 hash, or 8 consistent hash) is allowed for DSR mode (3): set sel to 1")
	}
	if s.Security < SecurityPlain || s.Security > SecurityE2ETLS {
		return invalid(svcField("security"), "%d is out of range 0..2 (0 plain, 1 TLS termination, 2 end-to-end TLS)", s.Security)
	}
	if s.Security != SecurityPlain && s.Mode != ModeFullProxy {
		return invalid(svcField("security"), "TLS levels need mode=fullproxy (4): lower modes do not terminate connections")
	}
	if s.Block < 0 {
		return invalid(svcField("block"), "must not be negative")
	}
	switch strings.ToLower(s.ProbeType) {
	case "", "tcp", "udp", "sctp", "http", "https", "ping", "icmp", "none": // icmp: ping's other name
		s.ProbeType = strings.ToLower(s.ProbeType)
	default:
		return invalid(svcField("probetype"), "%q is not one of tcp, udp, sctp, http, https, ping (icmp), none", s.ProbeType)
	}
	if s.ProbePort < 0 || s.ProbePort > 65535 {
		return invalid(svcField("probeport"), "%d is out of range 0..65535", s.ProbePort)
	}
	if s.ProbeTimeout < 0 || s.ProbeTimeout > MaxProbeTimeout {
		return invalid(svcField("probeTimeout"), "%d is out of range 0..%d seconds", s.ProbeTimeout, MaxProbeTimeout)
	}
	if s.ProbeRetries < 0 || s.ProbeRetries > MaxProbeRetries {
		return invalid(svcField("probeRetries"), "%d is out of range 0..%d", s.ProbeRetries, MaxProbeRetries)
	}
	switch s.ProbeType {
	case "tcp", "http", "https":
		if s.Protocol == "icmp" && s.ProbePort == 0 {
			return invalid(svcField("probeport"), "is required for a %s probe of an icmp rule (its endpoints have no target port)", s.ProbeType)
		}
	}
	if err := checkProbeReq(s); err != nil {
		return err
	}
	if len(s.ProbeResp) > MaxProbeTextLen || hasControl(s.ProbeResp) {
		return invalid(svcField("proberesp"), "must be at most %d bytes without control characters", MaxProbeTextLen)
	}
	if err := checkName(s.Name); err != nil {
		return err
	}
	if len(s.ModelName) > MaxModelNameLen || hasControl(s.ModelName) {
		return invalid(svcField("model_name"), "must be at most %d bytes without control characters", MaxModelNameLen)
	}
	if s.SessionHeaderName != "" && !isHeaderToken(s.SessionHeaderName) {
		return invalid(svcField("session_header_name"), "%q is not an HTTP header name (at most %d letters, digits and !#$%%&'*+-.^_`|~)", s.SessionHeaderName, MaxNameLen)
	}
	if s.InactiveTimeOut < 0 || s.InactiveTimeOut > MaxInactiveTimout {
		return invalid(svcField("inactiveTimeOut"), "%d is out of range 0..%d seconds", s.InactiveTimeOut, MaxInactiveTimout)
	}
	if s.ModelName != "" && s.Mode != ModeFullProxy {
		return invalid(svcField("model_name"), "requires mode=fullproxy (4)")
	}
	if s.SessionHeaderName != "" && s.Mode != ModeFullProxy {
		return invalid(svcField("session_header_name"), "requires mode=fullproxy (4)")
	}
	return nil
}

// checkProbeReq: for http and https probes probereq is the URL path the
// probe requests, for the others an opaque payload; either is bounded.
func checkProbeReq(s *ServiceArgs) error {
	if len(s.ProbeReq) > MaxProbeTextLen {
		return invalid(svcField("probereq"), "%d bytes exceed the limit of %d", len(s.ProbeReq), MaxProbeTextLen)
	}
	if s.ProbeType != "http" && s.ProbeType != "https" || s.ProbeReq == "" {
		if hasControl(s.ProbeReq) {
			return invalid(svcField("probereq"), "must not hold control characters")
		}
		return nil
	}
	if !strings.HasPrefix(s.ProbeReq, "/") || strings.ContainsFunc(s.ProbeReq, func(c rune) bool { return c <= ' ' || c == 0x7f }) {
		return invalid(svcField("probereq"), "%q is not a URL path: an %s probe requests a path such as /health (no spaces or control characters)", s.ProbeReq, s.ProbeType)
	}
	return nil
}

// checkName: a rule name is a path segment of the delete-by-name API and a
// log field, so it is bounded and has no '/' and no control characters.
func checkName(n string) error {
	switch {
	case len(n) > MaxNameLen:
		return invalid(svcField("name"), "%d bytes exceed the limit of %d", len(n), MaxNameLen)
	case strings.ContainsRune(n, '/'):
		return invalid(svcField("name"), "%q must not contain '/' (it is a path segment of DELETE .../name/<name>)", n)
	case hasControl(n) || !utf8.ValidString(n):
		return invalid(svcField("name"), "must be valid UTF-8 without control characters")
	}
	return nil
}

func hasControl(s string) bool { return strings.ContainsFunc(s, unicode.IsControl) }

func isHeaderToken(s string) bool {
	if len(s) > MaxNameLen {
		return false
	}
	for i := 0; i < len(s); i++ {
		c := s[i]
		if !('a' <= c && c <= 'z' || 'A' <= c && c <= 'Z' || '0' <= c && c <= '9' || strings.IndexByte("!#$%&'*+-.^_`|~", c) >= 0) {
			return false
		}
	}
	return true
}

func validateEndpoints(r *Rule) error {
	if len(r.Endpoints) == 0 {
		return invalid("endpoints", "at least one endpoint is required")
	}
	if len(r.Endpoints) > MaxEndpoints {
		return invalid("endpoints", "%d endpoints exceed the limit of %d per rule", len(r.Endpoints), MaxEndpoints)
	}
	seen := map[string]int{}
	for i := range r.Endpoints {
		ep := &r.Endpoints[i]
		ep.State, ep.Draining, ep.KVParity, ep.KVExcluded = "", false, "", false
		a, err := netip.ParseAddr(strings.TrimSpace(ep.IP))
		if err != nil {
			return invalid(epField(i, "endpointIP"), "%q is not an IP address", ep.IP)
		}
		ep.IP = a.Unmap().String()
		if r.Service.Protocol == "icmp" {
			if ep.Port != 0 {
				return invalid(epField(i, "targetPort"), "must be 0 for icmp")
			}
		} else if ep.Port < 1 || ep.Port > 65535 {
			return invalid(epField(i, "targetPort"), "%d is out of range 1..65535", ep.Port)
		}
		if r.Service.Mode == ModeDSR && ep.Port != r.Service.Port {
			return invalid(epField(i, "targetPort"), "DSR does not translate ports: targetPort must equal the service port %d", r.Service.Port)
		}
		if ep.Weight < 0 || ep.Weight > 100 {
			return invalid(epField(i, "weight"), "%d is out of range 0..100", ep.Weight)
		}
		if ep.Role < RoleNone || ep.Role > RoleDecode {
			return invalid(epField(i, "ep_role"), "%d is not 0 (normal), 1 (prefill) or 2 (decode)", ep.Role)
		}
		if ep.Role != RoleNone && !r.Service.PDDisagg {
			return invalid(epField(i, "ep_role"), "endpoint roles need pd_disagg_mode=true; remove ep_role for a single pool")
		}
		if ep.NixlPort < 0 || ep.NixlPort > 65535 {
			return invalid(epField(i, "nixl_port"), "%d is out of range 0..65535", ep.NixlPort)
		}
		k := netipJoin(ep.IP, ep.Port)
		if j, dup := seen[k]; dup {
			return invalid(epField(i, "endpointIP"), "duplicates endpoints[%d] (%s)", j, k)
		}
		seen[k] = i
	}
	return nil
}

func validateKV(r *Rule) error {
	s := &r.Service
	eng, ok := engine.Lookup(s.KVEngine)
	if !ok {
		return invalid(svcField("kvEngineType"), "%q is not a known engine: use one of vllm, sglang, trtllm, or llamacpp", s.KVEngine)
	}
	if s.KVExactMode < KVExactOff || s.KVExactMode > maxKVExactMode {
		return invalid(svcField("kvExactMode"), "%d is out of range 0..3 (0 off, 1 P/D prefill pool, 3 single pool)", s.KVExactMode)
	}
	if s.KVExactMode == KVExactNATS {
		return invalid(svcField("kvExactMode"), "2 is reserved and not implemented: use 1 for a P/D pool or 3 for a single pool")
	}
	if s.PDDisagg && s.Mode != ModeFullProxy {
		return invalid(svcField("pd_disagg_mode"), "pd-disagg requires mode=fullproxy (4)")
	}
	if s.KVExactMode == KVExactSingle && s.PDDisagg {
		return invalid(svcField("kvExactMode"), "kv-exact single-role mode (3) is incompatible with pd-disagg: use kvExactMode=1 for P/D, or remove pd_disagg_mode for a single pool")
	}
	if s.KVExactMode == KVExactSingle && s.Mode != ModeFullProxy {
		return invalid(svcField("kvExactMode"), "kv-exact single-role mode (3) requires mode=fullproxy (4): set mode to 4")
	}
	if s.KVExactMode == KVExactPD && !s.PDDisagg {
		return invalid(svcField("kvExactMode"), "kv-exact P/D mode (1) requires pd_disagg_mode=true with prefill and decode endpoints; use kvExactMode=3 for a single pool")
	}
	if eng.Name == engine.LlamaCpp {
		switch {
		case s.KVExactMode != KVExactOff:
			return invalid(svcField("kvExactMode"), "kv-engine-type llamacpp supports plain load balancing only (fullproxy, chwbl, session affinity): remove kvExactMode")
		case s.PDDisagg:
			return invalid(svcField("pd_disagg_mode"), "kv-engine-type llamacpp has no gateway P/D contract: remove pd_disagg_mode")
		case s.KVHashAlgo != "":
			return invalid(svcField("kvHashAlgo"), "kv-engine-type llamacpp has no KV hash contract: remove kvHashAlgo")
		case s.PDBootstrap != 0:
			return invalid(svcField("pdBootstrapPort"), "kv-engine-type llamacpp has no P/D: remove pdBootstrapPort")
		case s.KVDpRankCount > 1:
			return invalid(svcField("kvDpRankCount"), "kv-engine-type llamacpp has no KV event ranks: remove kvDpRankCount")
		}
	}
	if s.PDDisagg {
		var prefill, decode int
		for _, ep := range r.Endpoints {
			switch ep.Role {
			case RolePrefill:
				prefill++
			case RoleDecode:
				decode++
			}
		}
		if prefill == 0 || decode == 0 {
			return invalid("endpoints", "pd-disagg requires at least 1 prefill (ep_role=1) and 1 decode (ep_role=2) endpoint (have %d prefill, %d decode)", prefill, decode)
		}
	}
	if s.KVDpRankCount < 0 || s.KVDpRankCount > engine.MaxDPRanks {
		return invalid(svcField("kvDpRankCount"), "%d must be within 1..%d (0 = default 1): split the deployment or reduce rank fan-out", s.KVDpRankCount, engine.MaxDPRanks)
	}
	if s.KVZmqPort < 0 || s.KVZmqPort > 65535 {
		return invalid(svcField("kvZmqPort"), "%d is out of range 1..65535", s.KVZmqPort)
	}
	ranks, port := max(s.KVDpRankCount, 1), s.KVZmqPort
	if port == 0 {
		port = engine.DefaultZMQPort
	}
	if last := port + ranks - 1; last > 65535 {
		return invalid(svcField("kvZmqPort"), "last rank port %d (kvZmqPort %d + %d ranks - 1) is above 65535: choose a lower base port", last, port, ranks)
	}
	if s.KVHashAlgo != "" {
		if !engine.KnownAlgo(s.KVHashAlgo) {
			return invalid(svcField("kvHashAlgo"), "%q must be one of \"sha256_cbor\", \"xxhash_cbor\", \"sha256_sglang\", \"blockhash_trtllm\"", s.KVHashAlgo)
		}
		if !eng.AllowsAlgo(s.KVHashAlgo) {
			return invalid(svcField("kvHashAlgo"), "%q is incompatible with kv-engine-type %q (omit kvHashAlgo to take the engine default %q)", s.KVHashAlgo, eng.Name, eng.DefaultAlgo)
		}
	}
	if s.PDBootstrap < 0 || s.PDBootstrap > 65535 {
		return invalid(svcField("pdBootstrapPort"), "%d is out of range 0..65535", s.PDBootstrap)
	}
	if s.PDBootstrap != 0 && !(s.PDDisagg && eng.Name == engine.SGLang) {
		return invalid(svcField("pdBootstrapPort"), "pd-bootstrap-port requires pd_disagg_mode=true and kv-engine-type sglang: remove the field")
	}
	if eng.Name == engine.TRTLLM {
		if s.KVZmqPort != 0 && s.KVZmqPort != engine.DefaultZMQPort {
			return invalid(svcField("kvZmqPort"), "kvZmqPort is meaningless for kv-engine-type trtllm (events ride the endpoint's serving port): remove it")
		}
		if s.KVDpRankCount > 1 {
			return invalid(svcField("kvDpRankCount"), "kvDpRankCount is meaningless for kv-engine-type trtllm (no client-visible DP ranks): remove it")
		}
	}
	if s.KVBlockSize < 0 || s.KVBlockSize > MaxBlockSize {
		return invalid(svcField("kvBlockSize"), "%d is out of range 1..%d (0 = default 16)", s.KVBlockSize, MaxBlockSize)
	}
	if s.KVWarmupSec != nil && *s.KVWarmupSec < 0 {
		return invalid(svcField("kvWarmupSec"), "must not be negative")
	}
	return nil
}

// normalize applies the documented defaults, so stored and echoed rules show
// the effective values.
func normalize(r *Rule) {
	s := &r.Service
	if s.KVEngine == "" {
		s.KVEngine = string(engine.Default)
	}
	eng, _ := engine.Lookup(s.KVEngine)
	if s.KVHashAlgo == "" && eng.KVExact {
		s.KVHashAlgo = eng.DefaultAlgo
	}
	if s.KVBlockSize == 0 {
		s.KVBlockSize = engine.DefaultBlockSize
	}
	if s.KVZmqPort == 0 {
		s.KVZmqPort = engine.DefaultZMQPort
	}
	if s.KVDpRankCount == 0 {
		s.KVDpRankCount = 1
	}
	if s.KVWarmupSec == nil {
		v := 30
		s.KVWarmupSec = &v
	}
	if s.ProbeType != "" && s.ProbeType != "none" {
		// loxilb: an explicit probe type turns monitoring on.
		s.Monitor = true
	}
}
