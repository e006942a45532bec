package lbrule

import (
	"encoding/base64"
	"fmt"
	"net/netip"
	"path"
	"strconv"
	"strings"
)

// loxilb rule fields beyond what this gateway routes on. Each is accepted,
// validated and echoed on read-back; the ones a rule sets that change
// nothing here are listed by Inert, which the create response and the
// capability API report, so a migrated rule file never loses a setting
// silently.

// MTLSFrontend is serviceArguments.mtls_frontend: client-certificate
// verification at the VIP.
type MTLSFrontend struct {
	ClientCertMode   string `json:"client_cert_mode,omitempty"` // disabled (default), optional, required
	ClientCAPath     string `json:"client_ca_path,omitempty"`
	ClientCACertData string `json:"client_ca_cert_data,omitempty"` // base64 PEM
	RequireClientCN  bool   `json:"require_client_cn,omitempty"`
	ClientCNPattern  string `json:"client_cn_pattern,omitempty"`
	ClientCRLPath    string `json:"client_crl_path,omitempty"`
}

// MTLSBackend is serviceArguments.mtls_backend: endpoint certificate
// verification and the client certificate presented to endpoints.
type MTLSBackend struct {
	VerifyServerCert *bool  `json:"verify_server_cert,omitempty"`
	BackendCAPath    string `json:"backend_ca_path,omitempty"`
	ClientCertPath   string `json:"client_cert_path,omitempty"`
	ClientKeyPath    string `json:"client_key_path,omitempty"`
	ClientCertData   string `json:"client_cert_data,omitempty"` // base64 PEM
	ClientKeyData    string `json:"client_key_data,omitempty"`  // base64 PEM
}

// Limits of the compatibility fields.
const (
	MaxPathLen           = 4096
	MaxInlinePEMLen      = 64 << 10 // base64 text of one inline PEM bundle
	MaxStreamDurationSec = 86400
	MaxPDSessionTTLSec   = 7 * 86400
	MaxPDBalanceAbs      = 1 << 20
	maxHeaderishLen      = 256
)

// ReasonMTLSFrontendUnsupported: a rule asks for client-certificate
// verification this gateway cannot give it (no client CA configured, or
// CRL checking); serving it without would downgrade the rule's security,
// so it is refused.
const ReasonMTLSFrontendUnsupported = "MTLS_FRONTEND_UNSUPPORTED"

// InertField is one accepted rule field that has no effect here.
type InertField struct {
	Field  string `json:"field"`
	Reason string `json:"reason"`
}

// inertReasons are the fields that are always inert, whatever their value.
var inertReasons = []InertField{
	{svcField("kvWarmupSec"), "accepted and echoed; loxilb never arms the warmup timer either: Tier 1.5 starts as soon as an endpoint's inventory has blocks"},
	{svcField("pd_cache_aware_mode"), "P/D prefill selection uses KV-exact matching (kvExactMode 1) and session_header_name affinity, not a radix trie"},
	{svcField("pd_session_ttl_sec"), "P/D session affinity follows session_header_name on the consistent-hash ring and does not expire"},
	{svcField("pd_cache_threshold"), "no radix-trie tier: KV-exact matching uses LLB_KV_MIN_MATCH_TOKENS"},
	{svcField("pd_balance_abs_threshold"), "no radix-trie tier: the KV-exact load blend (LOXILB_KV_LOAD_PENALTY) bounds imbalance"},
	{svcField("sse_mode"), "event streams are always relayed as they arrive; silence between events is bounded by --proxy-stream-idle-timeout"},
	{svcField("mtls_backend.verify_server_cert"), "endpoint certificates are always verified for security 2 (against backend_ca_path, the daemon's --proxy-tls-ca, or the system roots)"},
	{svcField("mtls_backend.client_cert_data"), "inline PEM is not loaded: use client_cert_path and client_key_path"},
	{svcField("mtls_backend.client_key_data"), "inline PEM is not loaded: use client_cert_path and client_key_path"},
	{svcField("mtls_frontend.client_cn_pattern"), "client CNs are matched only when require_client_cn is true"},
	{svcField("probetype"), "udp and sctp probes are not run: the endpoints count as healthy"},
	{"endpoints[].httpMethod", "HTTP probes use GET"},
	{"endpoints[].expectedCodes", "HTTP probes expect a 2xx status (and proberesp in the body when set)"},
	{"endpoints[].httpVersion", "HTTP probes use HTTP/1.1"},
	{"endpoints[].domainName", "HTTPS probes send no SNI or Host name of their own"},
}

// InertCatalog lists every field this gateway accepts without acting on it,
// with why (for the capability API).
func InertCatalog() []InertField {
	out := append([]InertField(nil), inertReasons...)
	out = append(out, InertField{svcField("chwbl_*"), "applies only to sel 8 (chwbl) and 10 (wrr-hash) on a mode-4 single pool; the L4 modes serve chwbl with a Maglev table, P/D pools do not use sel"})
	return out
}

func inertReason(field string) string {
	for _, f := range inertReasons {
		if f.Field == field {
			return f.Reason
		}
	}
	return ""
}

// Inert lists the fields a decoded (not yet normalized) rule sets that
// have no effect here, each with the reason.
func Inert(r *Rule) []InertField {
	s := &r.Service
	var out []InertField
	add := func(field, reason string) {
		if reason == "" {
			reason = inertReason(field)
		}
		out = append(out, InertField{Field: field, Reason: reason})
	}
	if s.KVWarmupSec != nil {
		add(svcField("kvWarmupSec"), "")
	}
	if s.PDCacheAware {
		add(svcField("pd_cache_aware_mode"), "")
	}
	if s.PDSessionTTLSec != 0 {
		add(svcField("pd_session_ttl_sec"), "")
	}
	if s.PDCacheThreshold != nil {
		add(svcField("pd_cache_threshold"), "")
	}
	if s.PDBalanceAbsThreshold != nil {
		add(svcField("pd_balance_abs_threshold"), "")
	}
	if s.SSEMode {
		add(svcField("sse_mode"), "")
	}
	if f := s.MTLSFrontend; f != nil && f.ClientCNPattern != "" && !f.RequireClientCN {
		add(svcField("mtls_frontend.client_cn_pattern"), "")
	}
	if b := s.MTLSBackend; b != nil {
		if b.VerifyServerCert != nil && !*b.VerifyServerCert {
			add(svcField("mtls_backend.verify_server_cert"), "")
		}
		if b.ClientCertData != "" {
			add(svcField("mtls_backend.client_cert_data"), "")
		}
		if b.ClientKeyData != "" {
			add(svcField("mtls_backend.client_key_data"), "")
		}
	}
	if pt := strings.ToLower(s.ProbeType); pt == "udp" || pt == "sctp" {
		add(svcField("probetype"), pt+" probes are not run: the endpoints count as healthy")
	}
	chwbl := []struct {
		name string
		set  bool
	}{
		{"chwbl_prefix_hash_level", s.ChwblPrefixHashLevel != 0},
		{"chwbl_prefix_hash_flags", s.ChwblPrefixHashFlags != 0},
		{"chwbl_mean_load_factor", s.ChwblMeanLoadFactor != 0},
		{"chwbl_replication", s.ChwblReplication != 0},
		{"chwbl_enable_cache_salt", s.ChwblEnableCacheSalt},
	}
	for _, c := range chwbl {
		switch {
		case !c.set:
		case !IsHashSel(s.Sel):
			add(svcField(c.name), fmt.Sprintf("applies only to sel 8 (chwbl) and 10 (wrr-hash); this rule has sel %d", s.Sel))
		case s.PDDisagg:
			add(svcField(c.name), "a prefill/decode pool picks prefill endpoints by KV-exact match and load, decode endpoints by load: sel does not apply")
		case s.Mode != ModeFullProxy:
			add(svcField(c.name), "the L4 modes serve chwbl with a Maglev table in the kernel; the prompt key and load bound need mode 4 (fullproxy)")
		}
	}
	for i, ep := range r.Endpoints {
		// monitorAddress and urlPath are honoured (the endpoint's probe
		// target and HTTP path).
		for _, f := range []struct{ name, v string }{{"httpMethod", ep.HTTPMethod},
			{"expectedCodes", ep.ExpectedCodes}, {"httpVersion", ep.HTTPVersion}, {"domainName", ep.DomainName}} {
			if f.v != "" {
				add(epField(i, f.name), inertReason("endpoints[]."+f.name))
			}
		}
	}
	return out
}

func validateCompat(r *Rule) error {
	s := &r.Service
	if err := validateChwbl(s); err != nil {
		return err
	}
	if s.PDCacheAware && !s.PDDisagg {
		return invalid(svcField("pd_cache_aware_mode"), "pd-cache-aware requires pd_disagg_mode=true")
	}
	if s.PDSessionTTLSec < 0 || s.PDSessionTTLSec > MaxPDSessionTTLSec {
		return invalid(svcField("pd_session_ttl_sec"), "%d is out of range 0..%d seconds (0 = no expiry)", s.PDSessionTTLSec, MaxPDSessionTTLSec)
	}
	if p := s.PDCacheThreshold; p != nil && (*p < 0 || *p > 100) {
		return invalid(svcField("pd_cache_threshold"), "%d is out of range 0..100 (default 20)", *p)
	}
	if p := s.PDBalanceAbsThreshold; p != nil && (*p < 0 || *p > MaxPDBalanceAbs) {
		return invalid(svcField("pd_balance_abs_threshold"), "%d is out of range 0..%d (default 3)", *p, MaxPDBalanceAbs)
	}
	if s.MaxStreamDurationSec < 0 || s.MaxStreamDurationSec > MaxStreamDurationSec {
		return invalid(svcField("max_stream_duration_sec"), "%d is out of range 0..%d seconds (0 = the 24 h cap)", s.MaxStreamDurationSec, MaxStreamDurationSec)
	}
	if (s.SSEMode || s.MaxStreamDurationSec != 0) && s.Mode != ModeFullProxy {
		field := "sse_mode"
		if !s.SSEMode {
			field = "max_stream_duration_sec"
		}
		return invalid(svcField(field), "requires mode=fullproxy (4): lower modes do not see HTTP")
	}
	if err := validateMTLS(s); err != nil {
		return err
	}
	if err := validateProfile(r); err != nil {
		return err
	}
	for i := range r.Endpoints {
		if err := validateEndpointHM(i, &r.Endpoints[i]); err != nil {
			return err
		}
	}
	return nil
}

func checkPath(field, p string) error {
	if p == "" {
		return nil
	}
	if len(p) > MaxPathLen || hasControl(p) || !path.IsAbs(p) {
		return invalid(field, "must be an absolute file path of at most %d bytes without control characters", MaxPathLen)
	}
	return nil
}

func checkPEMData(field, d string) error {
	if d == "" {
		return nil
	}
	if len(d) > MaxInlinePEMLen {
		return invalid(field, "%d bytes exceed the limit of %d", len(d), MaxInlinePEMLen)
	}
	b, err := base64.StdEncoding.DecodeString(d)
	if err != nil {
		return invalid(field, "is not base64: %v", err)
	}
	if !strings.Contains(string(b), "-----BEGIN ") {
		return invalid(field, "does not decode to PEM (no -----BEGIN line)")
	}
	return nil
}

func validateMTLS(s *ServiceArgs) error {
	if f := s.MTLSFrontend; f != nil {
		mode := strings.ToLower(f.ClientCertMode)
		switch mode {
		case "", "disabled", "optional", "required":
			f.ClientCertMode = mode
		default:
			return invalid(svcField("mtls_frontend.client_cert_mode"), "%q is not one of disabled, optional, required", f.ClientCertMode)
		}
		if s.Mode != ModeFullProxy || (s.Security != SecurityTLS && s.Security != SecurityE2ETLS) {
			return invalid(svcField("mtls_frontend"), "requires mode=fullproxy (4) and security 1 or 2 (the VIP terminates TLS)")
		}
		for _, c := range []struct{ f, v string }{{"client_ca_path", f.ClientCAPath}, {"client_crl_path", f.ClientCRLPath}} {
			if err := checkPath(svcField("mtls_frontend."+c.f), c.v); err != nil {
				return err
			}
		}
		if err := checkPEMData(svcField("mtls_frontend.client_ca_cert_data"), f.ClientCACertData); err != nil {
			return err
		}
		if len(f.ClientCNPattern) > maxHeaderishLen || hasControl(f.ClientCNPattern) {
			return invalid(svcField("mtls_frontend.client_cn_pattern"), "must be at most %d bytes without control characters", maxHeaderishLen)
		}
		if f.RequireClientCN && f.ClientCNPattern == "" {
			return invalid(svcField("mtls_frontend.client_cn_pattern"), "is required when require_client_cn is true")
		}
		if _, err := path.Match(f.ClientCNPattern, ""); err != nil {
			return invalid(svcField("mtls_frontend.client_cn_pattern"), "%q is not a glob pattern (* ? [a-z]): %v", f.ClientCNPattern, err)
		}
		if f.ClientCRLPath != "" && (mode == "optional" || mode == "required") {
			return &RuleError{Class: ErrPrecondition, Field: svcField("mtls_frontend.client_crl_path"), Reason: ReasonMTLSFrontendUnsupported,
				Msg: "this gateway does not check client certificates against a CRL; refusing rather than serving revoked certificates (remove client_crl_path and revoke by reissuing the client CA, or terminate mTLS in front of the gateway)"}
		}
		// optional and required are served when a client CA is known:
		// the rule's, or the daemon's --proxy-tls-client-ca (checked
		// when the rule is applied).
	}
	if b := s.MTLSBackend; b != nil {
		if s.Mode != ModeFullProxy || s.Security != SecurityE2ETLS {
			return invalid(svcField("mtls_backend"), "requires mode=fullproxy (4) and security 2 (TLS to the endpoints)")
		}
		for _, c := range []struct{ f, v string }{{"backend_ca_path", b.BackendCAPath}, {"client_cert_path", b.ClientCertPath}, {"client_key_path", b.ClientKeyPath}} {
			if err := checkPath(svcField("mtls_backend."+c.f), c.v); err != nil {
				return err
			}
		}
		for _, c := range []struct{ f, v string }{{"client_cert_data", b.ClientCertData}, {"client_key_data", b.ClientKeyData}} {
			if err := checkPEMData(svcField("mtls_backend."+c.f), c.v); err != nil {
				return err
			}
		}
		if (b.ClientCertPath == "") != (b.ClientKeyPath == "") {
			return invalid(svcField("mtls_backend.client_key_path"), "client_cert_path and client_key_path go together")
		}
	}
	return nil
}

func validateEndpointHM(i int, ep *Endpoint) error {
	if ep.MonitorAddress != "" {
		if _, err := parseAddr(ep.MonitorAddress); err != nil {
			return invalid(epField(i, "monitorAddress"), "%q is not an IP address", ep.MonitorAddress)
		}
	}
	if m := ep.HTTPMethod; m != "" {
		switch strings.ToUpper(m) {
		case "GET", "HEAD", "POST", "PUT", "DELETE", "OPTIONS", "PATCH", "CONNECT", "TRACE":
			ep.HTTPMethod = strings.ToUpper(m)
		default:
			return invalid(epField(i, "httpMethod"), "%q is not an HTTP method (GET, HEAD, POST, PUT, DELETE, OPTIONS, PATCH, CONNECT, TRACE)", m)
		}
	}
	if p := ep.URLPath; p != "" && (len(p) > MaxProbeTextLen || !strings.HasPrefix(p, "/") || strings.ContainsFunc(p, func(c rune) bool { return c <= ' ' || c == 0x7f })) {
		return invalid(epField(i, "urlPath"), "%q is not a URL path such as /healthz (at most %d bytes, no spaces or control characters)", p, MaxProbeTextLen)
	}
	if c := ep.ExpectedCodes; c != "" {
		if err := checkExpectedCodes(c); err != nil {
			return invalid(epField(i, "expectedCodes"), "%q: %v (write 200, 200,202 or 200-204)", c, err)
		}
	}
	switch ep.HTTPVersion {
	case "", "1.0", "1.1":
	default:
		return invalid(epField(i, "httpVersion"), "%q is not 1.0 or 1.1", ep.HTTPVersion)
	}
	if d := ep.DomainName; d != "" && !isDomainName(d) {
		return invalid(epField(i, "domainName"), "%q is not a DNS name", d)
	}
	return nil
}

// checkExpectedCodes accepts Octavia's forms: a code, a comma list, a range.
func checkExpectedCodes(s string) error {
	if len(s) > maxHeaderishLen {
		return fmt.Errorf("longer than %d bytes", maxHeaderishLen)
	}
	for _, part := range strings.Split(s, ",") {
		lo, hi, isRange := strings.Cut(strings.TrimSpace(part), "-")
		a, err := httpCode(lo)
		if err != nil {
			return err
		}
		if isRange {
			b, err := httpCode(hi)
			if err != nil {
				return err
			}
			if b < a {
				return fmt.Errorf("range %d-%d is reversed", a, b)
			}
		}
	}
	return nil
}

func httpCode(s string) (int, error) {
	n, err := strconv.Atoi(strings.TrimSpace(s))
	if err != nil || n < 100 || n > 599 {
		return 0, fmt.Errorf("%q is not an HTTP status code 100..599", s)
	}
	return n, nil
}

func isDomainName(s string) bool {
	if len(s) > 253 {
		return false
	}
	for _, label := range strings.Split(strings.TrimSuffix(s, "."), ".") {
		if label == "" || len(label) > 63 || label[0] == '-' || label[len(label)-1] == '-' {
			return false
		}
		for i := 0; i < len(label); i++ {
			c := label[i]
			if !('a' <= c && c <= 'z' || 'A' <= c && c <= 'Z' || '0' <= c && c <= '9' || c == '-' || c == '_') {
				return false
			}
		}
	}
	return true
}

func parseAddr(s string) (netip.Addr, error) { return netip.ParseAddr(strings.TrimSpace(s)) }

func clonePtr[T any](p *T) *T {
	if p == nil {
		return nil
	}
	v := *p
	return &v
}
