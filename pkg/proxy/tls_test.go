package proxy

import (
	"crypto/tls"
	"io"
	"log"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus/testutil"
)

func tlsClient(p *testPKI) *http.Client {
	return &http.Client{Transport: &http.Transport{
		TLSClientConfig:    &tls.Config{RootCAs: p.pool},
		DisableCompression: true,
	}}
}

// TestSecurityTLSTermination is security 1: TLS from the client, plain
// HTTP to the endpoint.
func TestSecurityTLSTermination(t *testing.T) {
	pki := newPKI(t)
	cert, key, _ := pki.leaf(t, "vip", "127.0.0.70")
	b, _ := echoBackend(t, "plain")
	p := newStaticPicker(hostPort(b))
	px := startProxy(t, "127.0.0.70", Config{}, Service{Security: SecurityTLS, CertFile: cert, KeyFile: key}, p)

	c := tlsClient(pki)
	for range 3 {
		resp, err := c.Post("https://"+px.addr+"/v1/completions", "application/json", strings.NewReader(`{"model":"m"}`))
		if err != nil {
			t.Fatal(err)
		}
		if resp.TLS == nil || resp.ProtoMajor != 1 {
			t.Errorf("client leg not TLS HTTP/1.1: tls=%v proto=%s", resp.TLS != nil, resp.Proto)
		}
		e := decodeEcho(t, resp)
		if e.Header.Get("X-Forwarded-Proto") != "https" {
			t.Errorf("X-Forwarded-Proto %q, want https", e.Header.Get("X-Forwarded-Proto"))
		}
	}
	if px.accept.Load() != 1 {
		t.Errorf("TLS keep-alive: %d connections for 3 requests", px.accept.Load())
	}
	// Plain HTTP on a TLS port does not get through.
	resp, err := newClient().Get("http://" + px.addr + "/")
	if err == nil {
		resp.Body.Close()
		if resp.StatusCode == 200 {
			t.Error("plaintext request served on a TLS rule")
		}
	}
}

// TestSecurityEndToEndTLS is security 2: TLS on both legs, endpoint
// certificates verified unless explicitly skipped.
func TestSecurityEndToEndTLS(t *testing.T) {
	pki := newPKI(t)
	vipCert, vipKey, _ := pki.leaf(t, "vip", "127.0.0.71", "127.0.0.72", "127.0.0.73")
	_, _, epPair := pki.leaf(t, "endpoint", "127.0.0.1")
	other := newPKI(t) // a CA that did not sign the endpoint

	b := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.TLS == nil {
			http.Error(w, "want TLS", 400)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		w.Write([]byte(`{"ok":true,"usage":{"prompt_tokens":3,"prompt_tokens_details":{"cached_tokens":0}}}`))
	}))
	b.TLS = &tls.Config{Certificates: []tls.Certificate{epPair}}
	b.Config.ErrorLog = log.New(io.Discard, "", 0) // the rejected handshake is expected
	b.StartTLS()
	defer b.Close()

	cases := []struct {
		name       string
		vip        string
		svc        Service
		wantStatus int
		wantCode   string
	}{
		{"verified", "127.0.0.71", Service{CAFile: pki.CAFile}, 200, ""},
		{"unknown authority", "127.0.0.72", Service{CAFile: other.CAFile}, 502, "upstream_tls_error"},
		{"explicit insecure skip", "127.0.0.73", Service{CAFile: other.CAFile, InsecureSkipVerify: true}, 200, ""},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			svc := tc.svc
			svc.Security, svc.CertFile, svc.KeyFile = SecurityE2ETLS, vipCert, vipKey
			p := newStaticPicker(hostPort(b))
			px := startProxy(t, tc.vip, Config{}, svc, p)
			resp, err := tlsClient(pki).Post("https://"+px.addr+"/v1/completions", "application/json", strings.NewReader(`{}`))
			if err != nil {
				t.Fatal(err)
			}
			if resp.StatusCode != tc.wantStatus {
				t.Fatalf("status %d, want %d", resp.StatusCode, tc.wantStatus)
			}
			if tc.wantCode != "" {
				eb := readErrorBody(t, resp)
				if eb.Code != tc.wantCode || !strings.Contains(eb.Message, "certificate") || !strings.Contains(eb.Message, hostPort(b)) {
					t.Errorf("error %+v: want code %s and a message naming the certificate problem and the endpoint", eb, tc.wantCode)
				}
				r := p.waitResult(t)
				if r.Class != ClassTLS {
					t.Errorf("class %q, want tls", r.Class)
				}
				return
			}
			resp.Body.Close()
			if r := p.waitResult(t); !r.HasCachedTokens || r.PromptTokens != 3 {
				t.Errorf("usage over TLS: %+v", r)
			}
			// A second request reuses the pooled TLS connection to the
			// endpoint (the liveness probe must not mistake TLS
			// housekeeping for a dead connection).
			resp, err = tlsClient(pki).Post("https://"+px.addr+"/v1/completions", "application/json", strings.NewReader(`{}`))
			if err != nil {
				t.Fatal(err)
			}
			_, _ = io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			if resp.StatusCode != 200 {
				t.Fatalf("second request: %d", resp.StatusCode)
			}
			p.waitResult(t)
			if d := px.table.Load().list[0].up.dials.Load(); d != 1 {
				t.Errorf("%d TLS dials to the endpoint for 2 requests, want 1", d)
			}
		})
	}
}

// TestSecurityEndToEndMutualTLS: an endpoint that demands a client
// certificate gets the configured one; without it the handshake fails
// and the client is told so with a 502.
func TestSecurityEndToEndMutualTLS(t *testing.T) {
	pki := newPKI(t)
	vipCert, vipKey, _ := pki.leaf(t, "vip", "127.0.0.74", "127.0.0.75")
	_, _, epPair := pki.leaf(t, "endpoint", "127.0.0.1")
	clientCert, clientKey, _ := pki.leaf(t, "proxy-client")
	b := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if len(r.TLS.PeerCertificates) == 0 {
			http.Error(w, "no client certificate", 400)
		}
	}))
	b.TLS = &tls.Config{Certificates: []tls.Certificate{epPair}, ClientAuth: tls.RequireAndVerifyClientCert, ClientCAs: pki.pool}
	b.Config.ErrorLog = log.New(io.Discard, "", 0)
	b.StartTLS()
	defer b.Close()

	for _, tc := range []struct {
		vip        string
		withCert   bool
		wantStatus int
	}{{"127.0.0.74", true, 200}, {"127.0.0.75", false, 502}} {
		svc := Service{Security: SecurityE2ETLS, CertFile: vipCert, KeyFile: vipKey, CAFile: pki.CAFile}
		if tc.withCert {
			svc.ClientCertFile, svc.ClientKeyFile = clientCert, clientKey
		}
		p := newStaticPicker(hostPort(b))
		px := startProxy(t, tc.vip, Config{}, svc, p)
		resp, err := tlsClient(pki).Get("https://" + px.addr + "/")
		if err != nil {
			t.Fatal(err)
		}
		if resp.StatusCode != tc.wantStatus {
			t.Errorf("client cert %v: status %d, want %d", tc.withCert, resp.StatusCode, tc.wantStatus)
		}
		if tc.withCert {
			resp.Body.Close()
			continue
		}
		// The endpoint's refusal is a TLS failure, counted as one.
		if eb := readErrorBody(t, resp); eb.Code != "upstream_tls_error" || !strings.Contains(eb.Message, "certificate") {
			t.Errorf("error %+v: want upstream_tls_error naming the certificate", eb)
		}
		if r := p.waitResult(t); r.Class != ClassTLS {
			t.Errorf("class %q, want tls", r.Class)
		}
		if n := testutil.ToFloat64(px.m.upstreamErrs.WithLabelValues("7", "0", "tls")); n != 1 {
			t.Errorf("%v TLS upstream errors counted, want 1", n)
		}
	}
}

// TestUpdateToTLSStopsPlaintextKeepAlive: once a rule requires TLS, a
// plaintext keep-alive connection from before the change is refused and
// closed.
func TestUpdateToTLSStopsPlaintextKeepAlive(t *testing.T) {
	pki := newPKI(t)
	cert, key, _ := pki.leaf(t, "vip", "127.0.0.76")
	b, _ := echoBackend(t, "b0")
	px := startProxy(t, "127.0.0.76", Config{}, Service{}, newStaticPicker(hostPort(b)))
	c := newClient()
	resp, err := c.Get("http://" + px.addr + "/")
	if err != nil {
		t.Fatal(err)
	}
	_ = decodeEcho(t, resp)
	listen := px.table.Load().list[0].cfg.Listen
	if err := px.Update(Config{Services: []Service{{ID: 7, Listen: listen, Security: SecurityTLS, CertFile: cert, KeyFile: key}}}); err != nil {
		t.Fatal(err)
	}
	resp, err = c.Get("http://" + px.addr + "/")
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusServiceUnavailable || !resp.Close {
		t.Errorf("plaintext request after TLS was turned on: %d close=%v", resp.StatusCode, resp.Close)
	}
	resp, err = tlsClient(pki).Get("https://" + px.addr + "/")
	if err != nil {
		t.Fatal(err)
	}
	_ = decodeEcho(t, resp)
}
