package lbrule

import (
	"encoding/json"
	"errors"
	"os"
	"strings"
	"testing"
)

var seeded = Settings{VLLMSeed: "12345"}

func mustDecodeFile(t *testing.T, path string) *Rule {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	r, err := Decode(b)
	if err != nil {
		t.Fatalf("%s: %v", path, err)
	}
	return r
}

func TestSpecBodiesAccepted(t *testing.T) {
	for _, f := range []string{"testdata/seed_sglang_single.json", "testdata/seed_vllm_pd.json", "testdata/seed_sglang_ranks.json"} {
		r := mustDecodeFile(t, f)
		got, err := Prepare(r, seeded)
		if err != nil {
			t.Fatalf("%s rejected: %v", f, err)
		}
		if got.Service.KVHashAlgo == "" || got.Service.KVBlockSize != 16 || got.WarmupSec() != 30 {
			t.Errorf("%s: defaults not applied: %+v", f, got.Service)
		}
	}
}

func TestDefaults(t *testing.T) {
	r := baseSingle()
	r.Service.KVEngine, r.Service.KVHashAlgo, r.Service.KVZmqPort, r.Service.KVDpRankCount, r.Service.KVBlockSize = "", "", 0, 0, 0
	got, err := Prepare(r, seeded)
	if err != nil {
		t.Fatal(err)
	}
	s := got.Service
	if s.KVEngine != "vllm" || s.KVHashAlgo != "sha256_cbor" || s.KVZmqPort != 5557 || s.KVDpRankCount != 1 || s.KVBlockSize != 16 {
		t.Errorf("defaults: %+v", s)
	}
	for eng, algo := range map[string]string{"sglang": "sha256_sglang", "trtllm": "blockhash_trtllm"} {
		r := baseSingle()
		r.Service.KVEngine, r.Service.KVHashAlgo = eng, ""
		got, err := Prepare(r, Settings{})
		if err != nil {
			t.Fatal(err)
		}
		if got.Service.KVHashAlgo != algo {
			t.Errorf("%s default algo %q want %q", eng, got.Service.KVHashAlgo, algo)
		}
	}
	z := 0
	r = baseSingle()
	r.Service.KVWarmupSec = &z
	got, _ = Prepare(r, seeded)
	if got.WarmupSec() != 0 {
		t.Error("explicit kvWarmupSec 0 lost")
	}
}

func baseSingle() *Rule {
	return &Rule{
		Service: ServiceArgs{ExternalIP: "127.0.0.10", Port: 2090, Protocol: "tcp", Mode: 4, Sel: 8,
			KVExactMode: 3, KVEngine: "sglang", KVDpRankCount: 1, KVZmqPort: 5557, KVBlockSize: 16},
		Endpoints: []Endpoint{{IP: "127.0.0.11", Port: 30000, Weight: 1}, {IP: "127.0.0.12", Port: 30000, Weight: 1}},
	}
}

func basePD() *Rule {
	return &Rule{
		Service:   ServiceArgs{ExternalIP: "127.0.0.10", Port: 8080, Protocol: "tcp", Mode: 4, PDDisagg: true, KVExactMode: 1, KVEngine: "vllm"},
		Endpoints: []Endpoint{{IP: "127.0.0.11", Port: 8000, Role: RolePrefill}, {IP: "127.0.0.12", Port: 8000, Role: RoleDecode}},
	}
}

func TestRejections(t *testing.T) {
	cases := []struct {
		name  string
		rule  func() *Rule
		class error
		field string
		msg   string
	}{
		{"kv mode 3 with P/D", func() *Rule { r := basePD(); r.Service.KVExactMode = 3; return r }, ErrInvalid, "kvExactMode", "incompatible with pd-disagg"},
		{"kv mode 3 outside fullproxy", func() *Rule { r := baseSingle(); r.Service.Mode = 0; r.Service.Sel = 0; return r }, ErrInvalid, "kvExactMode", "requires mode=fullproxy"},
		{"kv mode 1 without P/D", func() *Rule { r := baseSingle(); r.Service.KVExactMode = 1; return r }, ErrInvalid, "kvExactMode", "requires pd_disagg_mode=true"},
		{"kv mode 2 reserved", func() *Rule { r := baseSingle(); r.Service.KVExactMode = 2; return r }, ErrInvalid, "kvExactMode", "reserved"},
		{"kv mode out of range", func() *Rule { r := baseSingle(); r.Service.KVExactMode = 4; return r }, ErrInvalid, "kvExactMode", "out of range"},
		{"unknown engine", func() *Rule { r := baseSingle(); r.Service.KVEngine = "tgi"; return r }, ErrInvalid, "kvEngineType", "vllm, sglang, trtllm, or llamacpp"},
		{"llamacpp kv exact", func() *Rule { r := baseSingle(); r.Service.KVEngine = "llamacpp"; r.Service.KVHashAlgo = ""; return r }, ErrInvalid, "kvExactMode", "plain load balancing only"},
		{"llamacpp P/D", func() *Rule { r := basePD(); r.Service.KVEngine = "llamacpp"; r.Service.KVExactMode = 0; return r }, ErrInvalid, "pd_disagg_mode", "llamacpp"},
		{"llamacpp hash algo", func() *Rule {
			r := baseSingle()
			r.Service.KVEngine, r.Service.KVExactMode, r.Service.KVHashAlgo = "llamacpp", 0, "sha256_cbor"
			return r
		}, ErrInvalid, "kvHashAlgo", "llamacpp"},
		{"ranks above 8", func() *Rule { r := baseSingle(); r.Service.KVDpRankCount = 9; return r }, ErrInvalid, "kvDpRankCount", "1..8"},
		{"ranks negative", func() *Rule { r := baseSingle(); r.Service.KVDpRankCount = -1; return r }, ErrInvalid, "kvDpRankCount", "1..8"},
		{"last rank port above 65535", func() *Rule { r := baseSingle(); r.Service.KVZmqPort, r.Service.KVDpRankCount = 65534, 3; return r }, ErrInvalid, "kvZmqPort", "last rank port 65536"},
		{"unknown algo", func() *Rule { r := baseSingle(); r.Service.KVHashAlgo = "md5"; return r }, ErrInvalid, "kvHashAlgo", "must be one of"},
		{"sglang with vllm algo", func() *Rule { r := baseSingle(); r.Service.KVHashAlgo = "sha256_cbor"; return r }, ErrInvalid, "kvHashAlgo", "incompatible with kv-engine-type \"sglang\""},
		{"vllm with sglang algo", func() *Rule { r := basePD(); r.Service.KVHashAlgo = "sha256_sglang"; return r }, ErrInvalid, "kvHashAlgo", "take the engine default \"sha256_cbor\""},
		{"trtllm with xxhash", func() *Rule {
			r := baseSingle()
			r.Service.KVEngine, r.Service.KVHashAlgo = "trtllm", "xxhash_cbor"
			return r
		}, ErrInvalid, "kvHashAlgo", "incompatible"},
		{"bootstrap port outside sglang P/D", func() *Rule { r := baseSingle(); r.Service.PDBootstrap = 9000; return r }, ErrInvalid, "pdBootstrapPort", "requires pd_disagg_mode=true and kv-engine-type sglang"},
		{"bootstrap port on vllm P/D", func() *Rule { r := basePD(); r.Service.PDBootstrap = 9000; return r }, ErrInvalid, "pdBootstrapPort", "sglang"},
		{"P/D without decode", func() *Rule { r := basePD(); r.Endpoints[1].Role = RolePrefill; return r }, ErrInvalid, "endpoints", "at least 1 prefill"},
		{"P/D without prefill", func() *Rule { r := basePD(); r.Endpoints[0].Role = RoleDecode; return r }, ErrInvalid, "endpoints", "1 decode"},
		{"P/D outside fullproxy", func() *Rule { r := basePD(); r.Service.Mode = 2; return r }, ErrInvalid, "pd_disagg_mode", "requires mode=fullproxy"},
		{"roles without P/D", func() *Rule { r := baseSingle(); r.Endpoints[0].Role = RolePrefill; return r }, ErrInvalid, "ep_role", "pd_disagg_mode"},
		{"wrr-hash outside fullproxy", func() *Rule {
			r := baseSingle()
			r.Service.KVExactMode, r.Service.Mode, r.Service.Sel = 0, 2, SelWRRHash
			return r
		}, ErrInvalid, "sel", "wrr-hash(10) requires mode=fullproxy"},
		{"n2 outside fullproxy", func() *Rule {
			r := baseSingle()
			r.Service.KVExactMode, r.Service.Mode, r.Service.Sel = 0, 0, 5
			return r
		}, ErrInvalid, "sel", "n2(5)"},
		{"gpu-aware outside fullproxy", func() *Rule {
			r := baseSingle()
			r.Service.KVExactMode, r.Service.Mode, r.Service.Sel = 0, 1, 9
			return r
		}, ErrInvalid, "sel", "gpuaware(9)"},
		{"wrr-hash outside fullproxy", func() *Rule {
			r := baseSingle()
			r.Service.KVExactMode, r.Service.Mode, r.Service.Sel = 0, 0, 10
			return r
		}, ErrInvalid, "sel", "wrr-hash(10)"},
		{"DSR with rr", func() *Rule {
			r := baseSingle()
			r.Service.KVExactMode, r.Service.Mode, r.Service.Sel = 0, 3, 0
			return r
		}, ErrInvalid, "sel", "only hash selection"},
		{"trtllm zmq port", func() *Rule {
			r := baseSingle()
			r.Service.KVEngine, r.Service.KVHashAlgo, r.Service.KVZmqPort = "trtllm", "", 6000
			return r
		}, ErrInvalid, "kvZmqPort", "meaningless for kv-engine-type trtllm"},
		{"trtllm ranks", func() *Rule {
			r := baseSingle()
			r.Service.KVEngine, r.Service.KVHashAlgo, r.Service.KVDpRankCount = "trtllm", "", 2
			return r
		}, ErrInvalid, "kvDpRankCount", "meaningless for kv-engine-type trtllm"},
		{"sel 7 reserved", func() *Rule { r := baseSingle(); r.Service.Sel = 7; return r }, ErrInvalid, "sel", "reserved"},
		{"bad VIP", func() *Rule { r := baseSingle(); r.Service.ExternalIP = "10.0.0"; return r }, ErrInvalid, "externalIP", "not an IP"},
		{"missing VIP", func() *Rule { r := baseSingle(); r.Service.ExternalIP = ""; return r }, ErrInvalid, "externalIP", "required"},
		{"bad port", func() *Rule { r := baseSingle(); r.Service.Port = 70000; return r }, ErrInvalid, "port", "1..65535"},
		{"bad protocol", func() *Rule { r := baseSingle(); r.Service.Protocol = "quic"; return r }, ErrInvalid, "protocol", "not one of"},
		{"fullproxy over udp", func() *Rule { r := baseSingle(); r.Service.Protocol = "udp"; return r }, ErrInvalid, "protocol", "needs protocol tcp"},
		{"no endpoints", func() *Rule { r := baseSingle(); r.Endpoints = nil; return r }, ErrInvalid, "endpoints", "at least one"},
		{"bad endpoint IP", func() *Rule { r := baseSingle(); r.Endpoints[1].IP = "x"; return r }, ErrInvalid, "endpoints[1].endpointIP", "not an IP"},
		{"duplicate endpoint", func() *Rule { r := baseSingle(); r.Endpoints[1] = r.Endpoints[0]; return r }, ErrInvalid, "endpoints[1].endpointIP", "duplicates"},
		{"bad target port", func() *Rule { r := baseSingle(); r.Endpoints[0].Port = 0; return r }, ErrInvalid, "endpoints[0].targetPort", "1..65535"},
		{"security out of range", func() *Rule { r := baseSingle(); r.Service.Security = 3; return r }, ErrInvalid, "security", "0..2"},
		{"TLS outside fullproxy", func() *Rule {
			r := baseSingle()
			r.Service.KVExactMode, r.Service.Mode, r.Service.Sel, r.Service.Security = 0, 0, 0, 1
			return r
		}, ErrInvalid, "security", "fullproxy"},
		{"inactive timeout", func() *Rule { r := baseSingle(); r.Service.InactiveTimeOut = 90000; return r }, ErrInvalid, "inactiveTimeOut", "0..86400"},
		{"probe type", func() *Rule { r := baseSingle(); r.Service.ProbeType = "grpc"; return r }, ErrInvalid, "probetype", "not one of"},
		{"block size", func() *Rule { r := baseSingle(); r.Service.KVBlockSize = -16; return r }, ErrInvalid, "kvBlockSize", "out of range"},
		{"DSR port translation", func() *Rule {
			r := baseSingle()
			r.Service.KVExactMode, r.Service.Mode, r.Service.Sel = 0, 3, 1
			return r
		}, ErrInvalid, "targetPort", "DSR does not translate"},
		{"hostonearm VIP", func() *Rule {
			r := baseSingle()
			r.Service.KVExactMode, r.Service.Mode, r.Service.Sel = 0, 5, 0
			return r
		}, ErrInvalid, "externalIP", "0.0.0.0"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			_, err := Prepare(c.rule(), seeded)
			if err == nil {
				t.Fatal("accepted")
			}
			var re *RuleError
			if !errors.As(err, &re) || !errors.Is(err, c.class) {
				t.Fatalf("error %v is not a %v RuleError", err, c.class)
			}
			if !strings.Contains(re.Field, c.field) || !strings.Contains(re.Error(), c.msg) {
				t.Errorf("got field %q msg %q; want field ~%q msg ~%q", re.Field, re.Error(), c.field, c.msg)
			}
		})
	}
}

func TestSeedPrecondition(t *testing.T) {
	for name, c := range map[string]struct {
		env    Settings
		reason string
	}{
		"unset":        {Settings{}, ReasonSeedUnset},
		"empty":        {Settings{VLLMSeed: ""}, ReasonSeedUnset},
		"too long":     {Settings{VLLMSeed: strings.Repeat("x", 24)}, ReasonSeedTooLong},
		"23 is fine":   {Settings{VLLMSeed: strings.Repeat("x", 23)}, ""},
		"vllm default": {Settings{VLLMSeed: "vllm-none-hash"}, ""},
	} {
		t.Run(name, func(t *testing.T) {
			_, err := Prepare(basePD(), c.env)
			if c.reason == "" {
				if err != nil {
					t.Fatal(err)
				}
				return
			}
			var re *RuleError
			if !errors.As(err, &re) || !errors.Is(err, ErrPrecondition) || re.Reason != c.reason {
				t.Fatalf("got %v, want precondition %s", err, c.reason)
			}
		})
	}
	// SGLang and TRT-LLM do not use the vLLM seed.
	if _, err := Prepare(baseSingle(), Settings{}); err != nil {
		t.Errorf("sglang needs no seed: %v", err)
	}
}

func TestDecodeErrors(t *testing.T) {
	cases := map[string]struct{ body, field, msg string }{
		"empty":         {"", "", "empty body"},
		"malformed":     {`{"serviceArguments": {`, "", "malformed JSON"},
		"unknown field": {`{"serviceArguments": {"kvExactMod": 3}, "endpoints": []}`, "kvExactMod", "unknown field"},
		"wrong type":    {`{"serviceArguments": {"port": "8080"}, "endpoints": []}`, "serviceArguments.port", "want an integer"},
		"wrong bool":    {`{"serviceArguments": {"pd_disagg_mode": 1}, "endpoints": []}`, "pd_disagg_mode", "true or false"},
		"trailing":      {`{"serviceArguments": {}, "endpoints": []} {}`, "", "after the JSON object"},
		"not object":    {`[1,2]`, "", "want an object"},
	}
	for name, c := range cases {
		t.Run(name, func(t *testing.T) {
			_, err := Decode([]byte(c.body))
			var re *RuleError
			if !errors.As(err, &re) || !errors.Is(err, ErrInvalid) {
				t.Fatalf("got %v", err)
			}
			if !strings.Contains(re.Field, c.field) || !strings.Contains(re.Error(), c.msg) {
				t.Errorf("got field %q msg %q", re.Field, re.Error())
			}
		})
	}
}

func TestRoundTrip(t *testing.T) {
	r := mustDecodeFile(t, "testdata/seed_vllm_pd.json")
	p, err := Prepare(r, seeded)
	if err != nil {
		t.Fatal(err)
	}
	b, _ := Encode(p)
	var m map[string]map[string]any
	_ = json.Unmarshal(b, &m)
	for _, k := range []string{"kvExactMode", "kvBlockSize", "kvHashAlgo", "kvZmqPort", "kvWarmupSec", "kvEngineType", "kvDpRankCount", "pd_disagg_mode"} {
		if _, ok := m["serviceArguments"][k]; !ok {
			t.Errorf("read-back lacks %s: %s", k, b)
		}
	}
	back, err := Decode(b)
	if err != nil {
		t.Fatalf("read-back does not decode: %v", err)
	}
	if _, err := Prepare(back, seeded); err != nil {
		t.Fatalf("read-back does not validate: %v", err)
	}
	if got := p.SubscribedEndpoints(); len(got) != 3 || got[0] != 0 || got[1] != 2 || got[2] != 4 {
		t.Errorf("mode 1 subscribes prefill endpoints only, got %v", got)
	}
}

// chwbl (8) on an L4 mode is the kernel's Maglev consistent hashing: valid
// for DNAT, one-arm, full NAT and DSR.
func TestConsistentHashOnL4Modes(t *testing.T) {
	for _, mode := range []int{ModeDNAT, ModeOneArm, ModeFullNAT, ModeDSR} {
		r := baseSingle()
		r.Service.KVExactMode, r.Service.KVEngine, r.Service.Mode, r.Service.Sel = 0, "", mode, SelCHWBL
		if mode == ModeDSR {
			for i := range r.Endpoints {
				r.Endpoints[i].Port = r.Service.Port
			}
		}
		if _, err := Prepare(r, seeded); err != nil {
			t.Errorf("mode %d with sel 8: %v", mode, err)
		}
	}
}
