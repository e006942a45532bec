package proxy

import (
	"crypto/tls"
	"net/http"
	"net/netip"
	"os"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus/testutil"
)

// TestClientCertFrontend: a rule with client certificates optional or
// required verifies what clients send at the VIP. Certificates from the
// client CA are served; none is served only when optional; one from
// another CA, or with a CN outside the pattern, is refused and counted.
func TestClientCertFrontend(t *testing.T) {
	pki := newPKI(t) // signs the VIP certificate and good clients
	vipCert, vipKey, _ := pki.leaf(t, "vip", "127.0.0.120", "127.0.0.121", "127.0.0.122", "127.0.0.123")
	_, _, good := pki.leaf(t, "client-a")
	other := newPKI(t)
	_, _, foreign := other.leaf(t, "client-a")
	caPEM, err := os.ReadFile(pki.CAFile)
	if err != nil {
		t.Fatal(err)
	}
	b, _ := echoBackend(t, "plain")

	type try struct {
		name   string
		cert   *tls.Certificate
		served bool
		reason string // counted refusal
	}
	cases := []struct {
		name  string
		vip   string
		svc   Service
		tries []try
	}{
		{"required", "127.0.0.120", Service{ClientAuth: ClientAuthRequired, ClientCAFile: pki.CAFile}, []try{
			{"no cert", nil, false, "client_cert_missing"},
			{"other CA", &foreign, false, "client_cert_invalid"},
			{"good", &good, true, ""},
		}},
		{"optional", "127.0.0.121", Service{ClientAuth: ClientAuthOptional, ClientCAFile: pki.CAFile}, []try{
			{"no cert", nil, true, ""},
			{"other CA", &foreign, false, "client_cert_invalid"},
			{"good", &good, true, ""},
		}},
		{"inline CA", "127.0.0.122", Service{ClientAuth: ClientAuthRequired, ClientCAPEM: caPEM}, []try{
			{"other CA", &foreign, false, "client_cert_invalid"},
			{"good", &good, true, ""},
		}},
		{"CN pattern", "127.0.0.123", Service{ClientAuth: ClientAuthOptional, ClientCAFile: pki.CAFile, ClientCNPattern: "client-b*"}, []try{
			{"no cert", nil, false, "client_cert_missing"},
			{"CN outside pattern", &good, false, "client_cn_mismatch"},
		}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			svc := tc.svc
			svc.Security, svc.CertFile, svc.KeyFile = SecurityTLS, vipCert, vipKey
			px := startProxy(t, tc.vip, Config{}, svc, newStaticPicker(hostPort(b)))
			for _, tr := range tc.tries {
				cfg := &tls.Config{RootCAs: pki.pool}
				if tr.cert != nil {
					cfg.Certificates = []tls.Certificate{*tr.cert}
				}
				c := &http.Client{Transport: &http.Transport{TLSClientConfig: cfg, DisableKeepAlives: true}}
				before := 0.0
				if tr.reason != "" {
					before = testutil.ToFloat64(px.m.connRejected.WithLabelValues(tr.reason))
				}
				resp, err := c.Post("https://"+px.addr+"/v1/completions", "application/json", strings.NewReader(`{"model":"m"}`))
				if tr.served {
					if err != nil {
						t.Fatalf("%s: %v", tr.name, err)
					}
					if resp.StatusCode != 200 {
						t.Errorf("%s: status %d, want 200", tr.name, resp.StatusCode)
					}
					_ = decodeEcho(t, resp)
					continue
				}
				if err == nil {
					resp.Body.Close()
					t.Fatalf("%s: served with status %d, want the handshake refused", tr.name, resp.StatusCode)
				}
				if got := testutil.ToFloat64(px.m.connRejected.WithLabelValues(tr.reason)); got != before+1 {
					t.Errorf("%s: %s counted %v times, want %v", tr.name, tr.reason, got, before+1)
				}
			}
		})
	}
}

// TestClientCertConfigErrors: client verification without a CA, or on a
// plaintext rule, is a configuration error naming the service.
func TestClientCertConfigErrors(t *testing.T) {
	for _, s := range []Service{
		{ID: 3, Security: SecurityTLS, CertFile: "c", KeyFile: "k", ClientAuth: ClientAuthRequired},
		{ID: 3, Security: SecurityPlain, ClientAuth: ClientAuthOptional, ClientCAFile: "/ca.pem"},
		{ID: 3, Security: SecurityTLS, CertFile: "c", KeyFile: "k", ClientAuth: ClientAuthOptional, ClientCAFile: "/ca.pem", ClientCNPattern: "["},
	} {
		s.Listen = netip.MustParseAddrPort("127.0.0.1:9")
		err := (Config{Services: []Service{s}}).withDefaults().validate()
		if err == nil || !strings.Contains(err.Error(), "service 3") {
			t.Errorf("%+v: err %v, want a config error naming service 3", s, err)
		}
	}
}
