package lbrule

import (
	"encoding/json"
	"errors"
	"os"
	"reflect"
	"strings"
	"testing"
)

func fullSchema(t *testing.T) []byte {
	t.Helper()
	b, err := os.ReadFile("testdata/loxilb_full_schema.json")
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// A loxilb rule file carrying every field this gateway knows decodes
// strictly, validates, and reads back with each field as written.
func TestFullSchemaRoundTrip(t *testing.T) {
	body := fullSchema(t)
	r, err := Decode(body)
	if err != nil {
		t.Fatal(err)
	}
	p, err := Prepare(r, Settings{})
	if err != nil {
		t.Fatal(err)
	}
	out, err := Encode(p)
	if err != nil {
		t.Fatal(err)
	}
	var in, back map[string]any
	if json.Unmarshal(body, &in) != nil || json.Unmarshal(out, &back) != nil {
		t.Fatal("unparsable")
	}
	sa, sb := in["serviceArguments"].(map[string]any), back["serviceArguments"].(map[string]any)
	for k, v := range sa {
		if !reflect.DeepEqual(sb[k], v) {
			t.Errorf("serviceArguments.%s: read back %v, sent %v", k, sb[k], v)
		}
	}
	ea, eb := in["endpoints"].([]any), back["endpoints"].([]any)
	for i := range ea {
		for k, v := range ea[i].(map[string]any) {
			if got := eb[i].(map[string]any)[k]; !reflect.DeepEqual(got, v) {
				t.Errorf("endpoints[%d].%s: read back %v, sent %v", i, k, got, v)
			}
		}
	}
	// The read-back body is itself a valid create body.
	if r2, err := Decode(out); err != nil {
		t.Fatalf("read-back does not decode: %v", err)
	} else if _, err := Prepare(r2, Settings{}); err != nil {
		t.Fatalf("read-back does not validate: %v", err)
	}
}

func TestFullSchemaInert(t *testing.T) {
	r, err := Decode(fullSchema(t))
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]string{}
	for _, f := range Inert(r) {
		if f.Reason == "" {
			t.Errorf("%s: no reason", f.Field)
		}
		got[f.Field] = f.Reason
	}
	for _, f := range []string{"kvWarmupSec", "pd_cache_aware_mode", "pd_session_ttl_sec", "pd_cache_threshold", "pd_balance_abs_threshold",
		"sse_mode", "mtls_backend.verify_server_cert", "mtls_backend.client_cert_data", "mtls_backend.client_key_data",
		"chwbl_prefix_hash_level", "chwbl_replication"} {
		if _, ok := got[svcField(f)]; !ok {
			t.Errorf("serviceArguments.%s not reported inert: %v", f, got)
		}
	}
	for _, f := range []string{"httpMethod", "expectedCodes", "httpVersion", "domainName"} {
		if _, ok := got[epField(0, f)]; !ok {
			t.Errorf("endpoints[0].%s not reported inert", f)
		}
	}
	// Honoured fields are not listed.
	for _, f := range []string{svcField("kvModelProfile"), svcField("max_stream_duration_sec"), svcField("mtls_backend.backend_ca_path"), svcField("probetype"), epField(0, "monitorAddress"), epField(0, "urlPath")} {
		if _, ok := got[f]; ok {
			t.Errorf("%s reported inert but it is honoured (or unset)", f)
		}
	}
	// chwbl_* are honoured on a mode-4 single pool with sel 8.
	single := &Rule{Service: ServiceArgs{Mode: ModeFullProxy, Sel: SelCHWBL, ChwblPrefixHashLevel: 3, ChwblReplication: 64}}
	if f := Inert(single); len(f) != 0 {
		t.Errorf("chwbl fields on sel 8 reported inert: %v", f)
	}
	single.Service.Sel = SelRR
	if f := Inert(single); len(f) != 2 || !strings.Contains(f[0].Reason, "sel 8") {
		t.Errorf("chwbl fields on sel 0 should be inert: %v", f)
	}
	for _, f := range InertCatalog() {
		if f.Field == "" || f.Reason == "" {
			t.Errorf("catalog entry %+v", f)
		}
	}
}

// Invalid values of the compatibility fields are refused with the field
// named; valid ones never are.
func TestCompatFieldsInvalid(t *testing.T) {
	cases := []struct {
		name, field string
		mut         func(*Rule)
		class       error
	}{
		{"level 4", "chwbl_prefix_hash_level", func(r *Rule) { r.Service.ChwblPrefixHashLevel = 4 }, ErrInvalid},
		{"flags 256", "chwbl_prefix_hash_flags", func(r *Rule) { r.Service.ChwblPrefixHashFlags = 256 }, ErrInvalid},
		{"factor 99", "chwbl_mean_load_factor", func(r *Rule) { r.Service.ChwblMeanLoadFactor = 99 }, ErrInvalid},
		{"replication 0..1024", "chwbl_replication", func(r *Rule) { r.Service.ChwblReplication = 1025 }, ErrInvalid},
		{"cache aware without P/D", "pd_cache_aware_mode", func(r *Rule) {
			r.Service.PDDisagg, r.Service.KVExactMode, r.Service.PDBootstrap, r.Endpoints[0].Role, r.Endpoints[1].Role = false, 0, 0, 0, 0
		}, ErrInvalid},
		{"threshold 101", "pd_cache_threshold", func(r *Rule) { v := 101; r.Service.PDCacheThreshold = &v }, ErrInvalid},
		{"balance negative", "pd_balance_abs_threshold", func(r *Rule) { v := -1; r.Service.PDBalanceAbsThreshold = &v }, ErrInvalid},
		{"stream negative", "max_stream_duration_sec", func(r *Rule) { r.Service.MaxStreamDurationSec = -1 }, ErrInvalid},
		{"stream above 24h", "max_stream_duration_sec", func(r *Rule) { r.Service.MaxStreamDurationSec = 86401 }, ErrInvalid},
		{"session ttl negative", "pd_session_ttl_sec", func(r *Rule) { r.Service.PDSessionTTLSec = -5 }, ErrInvalid},
		{"profile unknown", "kvModelProfile", func(r *Rule) { r.Service.KVModelProfile = "qwen-nope" }, ErrInvalid},
		{"profile wrong engine", "kvModelProfile", func(r *Rule) {
			r.Service.KVEngine, r.Service.PDBootstrap, r.Service.KVHashAlgo = "trtllm", 0, ""
		}, ErrInvalid},
		{"profile without exact", "kvModelProfile", func(r *Rule) { r.Service.KVExactMode = 0 }, ErrInvalid},
		{"frontend mode", "mtls_frontend.client_cert_mode", func(r *Rule) { r.Service.MTLSFrontend.ClientCertMode = "sometimes" }, ErrInvalid},
		{"frontend plaintext", "mtls_frontend", func(r *Rule) { r.Service.Security, r.Service.MTLSBackend = 0, nil }, ErrInvalid},
		{"frontend relative path", "mtls_frontend.client_ca_path", func(r *Rule) { r.Service.MTLSFrontend.ClientCAPath = "ca.crt" }, ErrInvalid},
		{"frontend bad base64", "mtls_frontend.client_ca_cert_data", func(r *Rule) { r.Service.MTLSFrontend.ClientCACertData = "%%%" }, ErrInvalid},
		{"frontend not PEM", "mtls_frontend.client_ca_cert_data", func(r *Rule) { r.Service.MTLSFrontend.ClientCACertData = "aGVsbG8=" }, ErrInvalid},
		{"frontend CN without pattern", "mtls_frontend.client_cn_pattern", func(r *Rule) { r.Service.MTLSFrontend.ClientCNPattern = "" }, ErrInvalid},
		{"frontend required with CRL", "mtls_frontend.client_crl_path", func(r *Rule) { r.Service.MTLSFrontend.ClientCertMode = "required" }, ErrPrecondition},
		{"frontend CN glob", "mtls_frontend.client_cn_pattern", func(r *Rule) { r.Service.MTLSFrontend.ClientCNPattern = "[a-" }, ErrInvalid},
		{"backend needs security 2", "mtls_backend", func(r *Rule) { r.Service.Security = 1 }, ErrInvalid},
		{"backend key without cert", "mtls_backend.client_key_path", func(r *Rule) { r.Service.MTLSBackend.ClientCertPath = "" }, ErrInvalid},
		{"monitorAddress", "monitorAddress", func(r *Rule) { r.Endpoints[0].MonitorAddress = "host" }, ErrInvalid},
		{"httpMethod", "httpMethod", func(r *Rule) { r.Endpoints[0].HTTPMethod = "FETCH" }, ErrInvalid},
		{"urlPath", "urlPath", func(r *Rule) { r.Endpoints[0].URLPath = "healthz" }, ErrInvalid},
		{"expectedCodes", "expectedCodes", func(r *Rule) { r.Endpoints[0].ExpectedCodes = "204-200" }, ErrInvalid},
		{"expectedCodes 700", "expectedCodes", func(r *Rule) { r.Endpoints[0].ExpectedCodes = "700" }, ErrInvalid},
		{"httpVersion", "httpVersion", func(r *Rule) { r.Endpoints[0].HTTPVersion = "2" }, ErrInvalid},
		{"domainName", "domainName", func(r *Rule) { r.Endpoints[0].DomainName = "bad name" }, ErrInvalid},
	}
	for _, c := range cases {
		r, err := Decode(fullSchema(t))
		if err != nil {
			t.Fatal(err)
		}
		c.mut(r)
		_, err = Prepare(r, Settings{})
		var re *RuleError
		if !errors.As(err, &re) || !errors.Is(err, c.class) || !strings.HasSuffix(re.Field, c.field) || re.Msg == "" {
			t.Errorf("%s: got %v, want %v naming %s", c.name, err, c.class, c.field)
		}
	}
	// icmp is ping's other name.
	r, _ := Decode(fullSchema(t))
	r.Service.ProbeType = "ICMP"
	if p, err := Prepare(r, Settings{}); err != nil || p.Service.ProbeType != "icmp" {
		t.Errorf("probetype icmp: %v", err)
	}
	// udp and sctp probe types are accepted (and reported inert).
	r, _ = Decode(fullSchema(t))
	r.Service.ProbeType = "udp"
	if _, err := Prepare(r, Settings{}); err != nil {
		t.Errorf("probetype udp: %v", err)
	}
	found := false
	for _, f := range Inert(r) {
		found = found || f.Field == svcField("probetype") && strings.Contains(f.Reason, "udp")
	}
	if !found {
		t.Errorf("probetype udp not reported inert: %v", Inert(r))
	}
}
