package lbrule

import (
	"errors"
	"os"
	"strings"
	"testing"
)

const plainBody = `{"serviceArguments":{"externalIP":"127.0.0.10","port":2090,"protocol":"tcp","mode":4,"sel":0,"kvExactMode":0,"pd_disagg_mode":false},"endpoints":[{"endpointIP":"127.0.0.11","targetPort":30000,"weight":1,"ep_role":0}]}`

// TestDecodeRejectsDuplicateAndCaseVariantKeys: encoding/json matches keys
// case-insensitively and keeps the last of duplicates; the strict decoder
// refuses both and names the key.
func TestDecodeRejectsDuplicateAndCaseVariantKeys(t *testing.T) {
	if _, err := Decode([]byte(plainBody)); err != nil {
		t.Fatalf("plain body rejected: %v", err)
	}
	for _, c := range []struct{ name, from, to, field string }{
		{"duplicate top-level key", `"endpoints":[`, `"endpoints":[],"endpoints":[`, "endpoints"},
		{"duplicate service key", `"port":2090,`, `"port":2090,"port":80,`, "serviceArguments.port"},
		{"duplicate endpoint key", `"targetPort":30000,`, `"targetPort":30000,"targetPort":1,`, "endpoints[0].targetPort"},
		{"externalIP lower case", `"externalIP"`, `"externalip"`, "serviceArguments.externalip"},
		{"kvExactMode all lower", `"kvExactMode"`, `"kvexactmode"`, "serviceArguments.kvexactmode"},
		{"pd_disagg_mode upper", `"pd_disagg_mode"`, `"PD_DISAGG_MODE"`, "serviceArguments.PD_DISAGG_MODE"},
		{"serviceArguments capitalised", `"serviceArguments"`, `"ServiceArguments"`, "ServiceArguments"},
		{"endpointIP case", `"endpointIP"`, `"endpointIp"`, "endpoints[0].endpointIp"},
		{"ep_role case", `"ep_role"`, `"EP_ROLE"`, "endpoints[0].EP_ROLE"},
		{"duplicate by case", `"port":2090,`, `"port":2090,"Port":80,`, "serviceArguments.Port"},
	} {
		t.Run(c.name, func(t *testing.T) {
			body := strings.Replace(plainBody, c.from, c.to, 1)
			_, err := Decode([]byte(body))
			var re *RuleError
			if !errors.As(err, &re) || !errors.Is(err, ErrInvalid) {
				t.Fatalf("accepted or unclassified: %v", err)
			}
			if re.Field != c.field {
				t.Fatalf("field %q, want %q (%v)", re.Field, c.field, err)
			}
		})
	}
	deep := strings.Repeat(`{"a":`, 100) + "1" + strings.Repeat("}", 100)
	if _, err := Decode([]byte(`{"serviceArguments":` + deep + `}`)); !errors.Is(err, ErrInvalid) {
		t.Fatalf("deep nesting: %v", err)
	}
}

// TestSeedKeysMatchExactly: every key of the loxilb bodies in testdata is
// accepted exactly as written.
func TestSeedKeysMatchExactly(t *testing.T) {
	for _, f := range []string{"testdata/seed_sglang_single.json", "testdata/seed_vllm_pd.json", "testdata/seed_sglang_ranks.json"} {
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		if err := checkKeys(b); err != nil {
			t.Errorf("%s: %v", f, err)
		}
	}
}

// TestAddressesNormalised: an IPv4-mapped IPv6 address is the IPv4 address,
// for the VIP (so the rule's key, delete and conflicts use it) and for
// endpoints.
func TestAddressesNormalised(t *testing.T) {
	r := baseSingle()
	r.Service.ExternalIP = "::ffff:127.0.0.10"
	r.Endpoints[0].IP = "::ffff:127.0.0.11"
	r.Endpoints[1].IP = "2001:DB8::0:1"
	got, err := Prepare(r, seeded)
	if err != nil {
		t.Fatal(err)
	}
	if got.Service.ExternalIP != "127.0.0.10" || got.Endpoints[0].IP != "127.0.0.11" || got.Endpoints[1].IP != "2001:db8::1" {
		t.Fatalf("not normalised: %s %s %s", got.Service.ExternalIP, got.Endpoints[0].IP, got.Endpoints[1].IP)
	}
	plain := baseSingle()
	p, _ := Prepare(plain, seeded)
	if got.Key() != p.Key() {
		t.Fatalf("mapped VIP key %v differs from the IPv4 key %v", got.Key(), p.Key())
	}
	// Two endpoints that differ only by mapping are the same endpoint.
	r = baseSingle()
	r.Endpoints[1].IP = "::ffff:127.0.0.11"
	r.Endpoints[1].Port = r.Endpoints[0].Port
	if _, err := Prepare(r, seeded); !errors.Is(err, ErrInvalid) {
		t.Fatalf("mapped duplicate endpoint accepted: %v", err)
	}
}

// TestConfigMistakesAreInvalid: mistakes in probes and names are 400s with
// the field named, never left to a stage that fails later with a 500.
func TestConfigMistakesAreInvalid(t *testing.T) {
	for _, c := range []struct {
		name, field string
		edit        func(s *ServiceArgs)
	}{
		{"probereq with spaces", "serviceArguments.probereq", func(s *ServiceArgs) { s.ProbeType, s.ProbeReq = "http", "GET /health HTTP/1.1" }},
		{"probereq with CRLF", "serviceArguments.probereq", func(s *ServiceArgs) { s.ProbeType, s.ProbeReq = "http", "/h\r\nX: y" }},
		{"probereq not a path", "serviceArguments.probereq", func(s *ServiceArgs) { s.ProbeType, s.ProbeReq = "https", "health" }},
		{"probereq huge", "serviceArguments.probereq", func(s *ServiceArgs) { s.ProbeType, s.ProbeReq = "tcp", strings.Repeat("a", 5000) }},
		{"proberesp control", "serviceArguments.proberesp", func(s *ServiceArgs) { s.ProbeType, s.ProbeResp = "http", "ok\x00" }},
		{"probeTimeout huge", "serviceArguments.probeTimeout", func(s *ServiceArgs) { s.ProbeType, s.ProbeTimeout = "tcp", 1<<40 }},
		{"probeRetries huge", "serviceArguments.probeRetries", func(s *ServiceArgs) { s.ProbeType, s.ProbeRetries = "tcp", 1000 }},
		{"probetype unknown", "serviceArguments.probetype", func(s *ServiceArgs) { s.ProbeType = "snmp" }},
		{"name too long", "serviceArguments.name", func(s *ServiceArgs) { s.Name = strings.Repeat("n", MaxNameLen+1) }},
		{"name with slash", "serviceArguments.name", func(s *ServiceArgs) { s.Name = "a/b" }},
		{"name with newline", "serviceArguments.name", func(s *ServiceArgs) { s.Name = "a\nb" }},
		{"name invalid utf-8", "serviceArguments.name", func(s *ServiceArgs) { s.Name = "a\xffb" }},
		{"model_name control", "serviceArguments.model_name", func(s *ServiceArgs) { s.ModelName = "m\x1b[2J" }},
		{"icmp tcp probe without port", "serviceArguments.probeport", func(s *ServiceArgs) { s.Mode, s.Sel, s.Protocol, s.Port, s.ProbeType = 0, 0, "icmp", 0, "tcp" }},
		{"session header not a token", "serviceArguments.session_header_name", func(s *ServiceArgs) { s.SessionHeaderName = "X Session" }},
	} {
		t.Run(c.name, func(t *testing.T) {
			r := baseSingle()
			c.edit(&r.Service)
			_, err := Prepare(r, seeded)
			var re *RuleError
			if !errors.As(err, &re) || !errors.Is(err, ErrInvalid) || re.Field != c.field {
				t.Fatalf("want 400 on %s, got %v", c.field, err)
			}
		})
	}
	r := baseSingle()
	r.Service.Name, r.Service.ProbeType, r.Service.ProbeReq, r.Service.SessionHeaderName = strings.Repeat("n", MaxNameLen), "http", "/v1/health?x=1", "X-Session-Id"
	if _, err := Prepare(r, seeded); err != nil {
		t.Fatalf("valid names and probe rejected: %v", err)
	}
}

// TestSeedNotUTF8IsPrecondition: a seed vLLM cannot hash is the daemon's
// environment's fault (412 with a reason), found before any stage builds a
// hasher from it (which failed as a 500).
func TestSeedNotUTF8IsPrecondition(t *testing.T) {
	_, err := Prepare(baseVLLM(), Settings{VLLMSeed: "a\xffb"})
	var re *RuleError
	if !errors.As(err, &re) || !errors.Is(err, ErrPrecondition) || re.Reason != ReasonSeedInvalid {
		t.Fatalf("want 412 %s, got %v", ReasonSeedInvalid, err)
	}
}

func baseVLLM() *Rule {
	r := baseSingle()
	r.Service.KVEngine, r.Service.KVHashAlgo = "vllm", ""
	return r
}
