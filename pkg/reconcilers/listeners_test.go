package reconcilers

import (
	"context"
	"encoding/base64"
	"errors"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/loxilb-llm/loxilb/pkg/control"
	"github.com/loxilb-llm/loxilb/pkg/lbrule"
	"github.com/loxilb-llm/loxilb/pkg/proxy"
	"github.com/loxilb-llm/loxilb/testbed/pki"
)

// rule is a mode-4 vLLM rule with two endpoints; kv is its kvExactMode.
func rule(kv int, model string) *lbrule.Rule {
	return &lbrule.Rule{Service: lbrule.ServiceArgs{ExternalIP: "127.0.0.77", Port: 9000, Protocol: "tcp", Mode: 4, KVExactMode: kv, KVEngine: "vllm", ModelName: model},
		Endpoints: []lbrule.Endpoint{{IP: "127.0.0.78", Port: 8000, Weight: 1}, {IP: "127.0.0.79", Port: 8000, Weight: 1}}}
}

// captureTable records the proxy table it is given and fails as told.
type captureTable struct {
	got proxy.Config
	err error
}

func (c *captureTable) Update(cfg proxy.Config) error { c.got = cfg; return c.err }

// TestListenerReconcilerTable: the proxy gets one service per mode-4 rule
// with the daemon's knobs and receipt policy and loxilb's 24 h stream cap
// when the rule sets none; other modes get none, and a rule whose TLS
// files the daemon lacks is that rule's 412 while the others are served.
func TestListenerReconcilerTable(t *testing.T) {
	prep := func(r *lbrule.Rule) *lbrule.Rule {
		p, err := lbrule.Prepare(r, lbrule.Settings{VLLMSeed: "1"})
		if err != nil {
			t.Fatal(err)
		}
		return p
	}
	plain := rule(0, "")
	capped := rule(0, "")
	capped.Service.ExternalIP, capped.Service.MaxStreamDurationSec = "127.0.0.88", 60
	tlsRule := rule(0, "")
	tlsRule.Service.ExternalIP, tlsRule.Service.Security = "127.0.0.89", 1
	l4 := rule(0, "")
	l4.Service.ExternalIP, l4.Service.Mode, l4.Service.KVEngine = "127.0.0.90", 0, ""
	svcs := []control.Service{{ID: 1, Rule: prep(plain)}, {ID: 2, Rule: prep(capped)}, {ID: 3, Rule: prep(tlsRule)}, {ID: 4, Rule: prep(l4)}}

	pt := &captureTable{}
	lr := &Listeners{Proxy: pt, Config: ListenerConfig{Proxy: proxy.Config{MaxBodyBytes: 1234}, Receipts: proxy.ReceiptsOnRequest}}
	err := lr.Reconcile(context.Background(), svcs)
	res := control.RuleErrors(err)
	if len(res) != 1 || res[0].ID != 3 || res[0].Reason != lbrule.ReasonProxyTLSUnset {
		t.Fatalf("a security-1 rule without the daemon's TLS files: %v", err)
	}
	if pt.got.MaxBodyBytes != 1234 || len(pt.got.Services) != 2 {
		t.Fatalf("proxy table %+v", pt.got)
	}
	s1, s2 := pt.got.Services[0], pt.got.Services[1]
	if s1.ID != 1 || s1.Listen.String() != "127.0.0.77:9000" || s1.Receipts != proxy.ReceiptsOnRequest || s1.MaxStreamDuration != lbrule.MaxStreamDurationSec*time.Second {
		t.Errorf("rule 1 as the proxy's service: %+v", s1)
	}
	if s2.ID != 2 || s2.MaxStreamDuration != time.Minute {
		t.Errorf("rule 2 as the proxy's service: %+v", s2)
	}

	// A table the proxy refuses as a whole is a stage failure, not a rule's.
	pt.err = errors.New("table refused")
	err = lr.Reconcile(context.Background(), svcs[:1])
	if err == nil || len(control.RuleErrors(err)) != 0 || !strings.Contains(err.Error(), "table refused") {
		t.Fatalf("whole-table failure: %v", err)
	}
}

// TestRuleTLSSources: which certificate files a rule gets — the daemon's
// by default, the rule's own mtls_backend/mtls_frontend in their place —
// and the 412s when a client CA is missing or a file is bad.
func TestRuleTLSSources(t *testing.T) {
	ca := pki.New(t)
	vipCert, vipKey, _ := ca.Leaf(t, "vip", "127.0.0.77")
	dCert, dKey, _ := ca.Leaf(t, "daemon-client")
	rCert, rKey, _ := ca.Leaf(t, "rule-client")
	ruleCA := pki.New(t)
	caPEM, _ := os.ReadFile(ruleCA.File)
	daemon := ListenerConfig{CertFile: vipCert, KeyFile: vipKey, ClientCertFile: dCert, ClientKeyFile: dKey}
	mk := func(sec int, fe *lbrule.MTLSFrontend, be *lbrule.MTLSBackend) *lbrule.Rule {
		r := rule(0, "")
		r.Service.Security, r.Service.MTLSFrontend, r.Service.MTLSBackend = sec, fe, be
		return r
	}
	cases := []struct {
		name   string
		cfg    func(c *ListenerConfig)
		r      *lbrule.Rule
		want   func(ps proxy.Service) bool
		reason string
		inMsg  string
	}{
		{"daemon client cert for security 2", nil, mk(2, nil, nil),
			func(ps proxy.Service) bool { return ps.ClientCertFile == dCert && ps.ClientKeyFile == dKey }, "", ""},
		{"no client cert for security 1", nil, mk(1, nil, nil),
			func(ps proxy.Service) bool { return ps.ClientCertFile == "" }, "", ""},
		{"rule client cert replaces the daemon's", nil, mk(2, nil, &lbrule.MTLSBackend{ClientCertPath: rCert, ClientKeyPath: rKey}),
			func(ps proxy.Service) bool { return ps.ClientCertFile == rCert && ps.ClientKeyFile == rKey }, "", ""},
		{"rule CA only keeps the daemon client cert", nil, mk(2, nil, &lbrule.MTLSBackend{BackendCAPath: ca.File}),
			func(ps proxy.Service) bool { return ps.ClientCertFile == dCert && ps.CAFile == ca.File }, "", ""},
		{"required without any client CA", nil, mk(1, &lbrule.MTLSFrontend{ClientCertMode: "required"}, nil),
			nil, lbrule.ReasonMTLSFrontendUnsupported, "--proxy-tls-client-ca"},
		{"required with the daemon client CA", func(c *ListenerConfig) { c.ClientCAFile = ca.File }, mk(1, &lbrule.MTLSFrontend{ClientCertMode: "required"}, nil),
			func(ps proxy.Service) bool {
				return ps.ClientAuth == proxy.ClientAuthRequired && ps.ClientCAFile == ca.File
			}, "", ""},
		{"optional with the rule's inline CA", func(c *ListenerConfig) { c.ClientCAFile = ca.File },
			mk(1, &lbrule.MTLSFrontend{ClientCertMode: "optional", ClientCACertData: base64.StdEncoding.EncodeToString(caPEM), RequireClientCN: true, ClientCNPattern: "svc-*"}, nil),
			func(ps proxy.Service) bool {
				return ps.ClientAuth == proxy.ClientAuthOptional && ps.ClientCAFile == "" && string(ps.ClientCAPEM) == string(caPEM) && ps.ClientCNPattern == "svc-*"
			}, "", ""},
		{"disabled asks nothing", nil, mk(1, &lbrule.MTLSFrontend{ClientCertMode: "disabled"}, nil),
			func(ps proxy.Service) bool { return ps.ClientAuth == proxy.ClientAuthOff }, "", ""},
		{"missing rule client CA file", nil, mk(1, &lbrule.MTLSFrontend{ClientCertMode: "required", ClientCAPath: "/nonexistent/ca.pem"}, nil),
			nil, lbrule.ReasonTLSFileInvalid, "/nonexistent/ca.pem"},
		{"missing rule client key", nil, mk(2, nil, &lbrule.MTLSBackend{ClientCertPath: rCert, ClientKeyPath: "/nonexistent/key.pem"}),
			nil, lbrule.ReasonTLSFileInvalid, "/nonexistent/key.pem"},
	}
	for _, c := range cases {
		cfg := daemon
		if c.cfg != nil {
			c.cfg(&cfg)
		}
		ps := proxy.Service{ID: 1, Security: proxy.Security(c.r.Service.Security)}
		err := cfg.ruleTLS(&ps, c.r)
		if c.reason != "" {
			var re *lbrule.RuleError
			if !errors.As(err, &re) || re.Reason != c.reason || !errors.Is(err, lbrule.ErrPrecondition) || !strings.Contains(re.Msg, c.inMsg) {
				t.Errorf("%s: err %v, want a 412 %s naming %s", c.name, err, c.reason, c.inMsg)
			}
			continue
		}
		if err != nil || !c.want(ps) {
			t.Errorf("%s: err %v, service %+v", c.name, err, ps)
		}
	}
}
