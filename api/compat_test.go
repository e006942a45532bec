package api_test

import (
	"strings"
	"testing"
)

// A loxilb rule file with every field: created, echoed on read-back, and
// the inert fields named in the create response and in the capabilities.
func TestFullSchemaCreateEchoInert(t *testing.T) {
	ts := newServer(t, "", "")
	body := readSeed(t, "loxilb_full_schema.json")
	code, res := do(t, ts, "POST", "/config/loadbalancer", body)
	if code != 200 || res["result"] != "Success" {
		t.Fatalf("create: %d %v", code, res)
	}
	inert := map[string]bool{}
	for _, f := range res["inert"].([]any) {
		m := f.(map[string]any)
		if m["reason"] == "" {
			t.Errorf("inert %v without a reason", m)
		}
		inert[m["field"].(string)] = true
	}
	for _, f := range []string{"serviceArguments.kvWarmupSec", "serviceArguments.sse_mode",
		"serviceArguments.pd_cache_aware_mode", "serviceArguments.pd_cache_threshold", "serviceArguments.pd_balance_abs_threshold",
		"serviceArguments.mtls_backend.verify_server_cert", "endpoints[0].httpMethod", "endpoints[1].expectedCodes"} {
		if !inert[f] {
			t.Errorf("create response does not name %s inert: %v", f, inert)
		}
	}
	if inert["serviceArguments.kvModelProfile"] {
		t.Error("kvModelProfile is honoured, not inert")
	}
	_, all := do(t, ts, "GET", "/config/loadbalancer/all", "")
	r := all["lbAttr"].([]any)[0].(map[string]any)
	sa := r["serviceArguments"].(map[string]any)
	for k, want := range map[string]any{"kvModelProfile": "sglang-completions-bos", "chwbl_prefix_hash_level": 2.0, "chwbl_mean_load_factor": 125.0,
		"pd_cache_threshold": 0.0, "sse_mode": true, "max_stream_duration_sec": 300.0, "pd_cache_aware_mode": true} {
		if sa[k] != want {
			t.Errorf("read-back %s = %v, want %v", k, sa[k], want)
		}
	}
	if fe := sa["mtls_frontend"].(map[string]any); fe["client_cn_pattern"] != "*.corp.example.com" {
		t.Errorf("mtls_frontend read-back: %v", fe)
	}
	if be := sa["mtls_backend"].(map[string]any); be["verify_server_cert"] != false || be["backend_ca_path"] != "/etc/loxilb/cert/backend_ca.crt" {
		t.Errorf("mtls_backend read-back: %v", be)
	}
	if ep := r["endpoints"].([]any)[0].(map[string]any); ep["expectedCodes"] != "200,202" || ep["monitorAddress"] != "127.0.0.241" {
		t.Errorf("endpoint read-back: %v", ep)
	}
	_, caps := do(t, ts, "GET", "/status/capabilities", "")
	found := map[string]bool{}
	for _, c := range caps["capabilities"].([]any) {
		m := c.(map[string]any)
		if name := m["name"].(string); strings.HasPrefix(name, "rule_field:") {
			if m["ready"] != false || m["reason_code"] != "inert" || m["reason"] == "" {
				t.Errorf("capability %v", m)
			}
			found[name] = true
		}
	}
	for _, f := range []string{"serviceArguments.kvWarmupSec", "serviceArguments.sse_mode", "serviceArguments.pd_cache_aware_mode", "endpoints[].expectedCodes"} {
		if !found["rule_field:"+f] {
			t.Errorf("capabilities lack rule_field:%s", f)
		}
	}
}

func TestFullSchemaRejections(t *testing.T) {
	ts := newServer(t, "", "")
	base := readSeed(t, "loxilb_full_schema.json")
	cases := map[string]struct {
		from, to string
		code     int
		field    string
	}{
		"level":       {`"chwbl_prefix_hash_level": 2`, `"chwbl_prefix_hash_level": 9`, 400, "serviceArguments.chwbl_prefix_hash_level"},
		"threshold":   {`"pd_cache_threshold": 0`, `"pd_cache_threshold": 150`, 400, "serviceArguments.pd_cache_threshold"},
		"profile":     {`"kvModelProfile": "sglang-completions-bos"`, `"kvModelProfile": "unknown-profile"`, 400, "serviceArguments.kvModelProfile"},
		"cert mode":   {`"client_cert_mode": "disabled"`, `"client_cert_mode": "maybe"`, 400, "serviceArguments.mtls_frontend.client_cert_mode"},
		"codes":       {`"expectedCodes": "200,202"`, `"expectedCodes": "ok"`, 400, "endpoints[0].expectedCodes"},
		"stream type": {`"max_stream_duration_sec": 300`, `"max_stream_duration_sec": "300"`, 400, "serviceArguments.max_stream_duration_sec"},
		"mtls typo":   {`"client_cn_pattern"`, `"client_cn_patern"`, 400, "client_cn_patern"},
		"required":    {`"client_cert_mode": "disabled"`, `"client_cert_mode": "required"`, 412, "serviceArguments.mtls_frontend.client_crl_path"},
	}
	for name, c := range cases {
		code, body := do(t, ts, "POST", "/config/loadbalancer", strings.Replace(base, c.from, c.to, 1))
		if code != c.code || body["field"] != c.field || body["message"] == "" {
			t.Errorf("%s: %d %v", name, code, body)
		}
	}
	if _, body := do(t, ts, "POST", "/config/loadbalancer", strings.Replace(base, `"client_cert_mode": "disabled"`, `"client_cert_mode": "required"`, 1)); body["reason_code"] != "MTLS_FRONTEND_UNSUPPORTED" {
		t.Errorf("frontend mTLS refusal has no reason code: %v", body)
	}
}
