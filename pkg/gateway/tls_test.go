package gateway

import (
	"context"
	"crypto/tls"
	"io"
	"log"
	"net"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/loxilb-llm/loxilb/pkg/control"
	"github.com/loxilb-llm/loxilb/pkg/lbrule"
	"github.com/loxilb-llm/loxilb/pkg/proxy"
	"github.com/loxilb-llm/loxilb/pkg/reconcilers"
	"github.com/loxilb-llm/loxilb/testbed/pki"
)

// TestBackendMutualTLSThroughGateway: an endpoint that requires a client
// certificate is served when the daemon has one (--proxy-tls-client-cert)
// and answers 502, counted as a TLS upstream error, when it has none.
func TestBackendMutualTLSThroughGateway(t *testing.T) {
	ca := pki.New(t)
	vipCert, vipKey, _ := ca.Leaf(t, "vip", "127.0.83.20", "127.0.83.21")
	_, _, epPair := ca.Leaf(t, "endpoint", "127.0.0.1")
	clientCert, clientKey, _ := ca.Leaf(t, "proxy-client")
	ep := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		_, _ = w.Write([]byte(`{"ok":true}`))
	}))
	ep.TLS = &tls.Config{Certificates: []tls.Certificate{epPair}, ClientAuth: tls.RequireAndVerifyClientCert, ClientCAs: ca.Pool}
	ep.Config.ErrorLog = log.New(io.Discard, "", 0) // the refused handshake is expected
	ep.StartTLS()
	t.Cleanup(ep.Close)
	epHost, epPort, _ := net.SplitHostPort(ep.Listener.Addr().String())

	for _, tc := range []struct {
		vip        string
		withCert   bool
		wantStatus int
	}{{"127.0.83.20", true, 200}, {"127.0.83.21", false, 502}} {
		lcfg := reconcilers.ListenerConfig{CertFile: vipCert, KeyFile: vipKey, CAFile: ca.File}
		if tc.withCert {
			lcfg.ClientCertFile, lcfg.ClientKeyFile = clientCert, clientKey
		}
		f := newFixture(t)
		reg := prometheus.NewRegistry()
		px, err := proxy.New(proxy.Config{}, f.g, f.g.inflight, nil, reg)
		if err != nil {
			t.Fatal(err)
		}
		lr := &reconcilers.Listeners{Proxy: px, Config: lcfg}
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan struct{})
		go func() { _ = px.Serve(ctx); close(done) }()
		<-px.Listening()

		ln, err := net.Listen("tcp", tc.vip+":0")
		if err != nil {
			t.Fatal(err)
		}
		port := ln.Addr().(*net.TCPAddr).Port
		ln.Close()
		r := rule(0, "")
		r.Service.ExternalIP, r.Service.Port, r.Service.Security = tc.vip, port, 2
		r.Endpoints = r.Endpoints[:1]
		r.Endpoints[0].IP = epHost
		r.Endpoints[0].Port, _ = strconv.Atoi(epPort)
		p, err := lbrule.Prepare(r, lbrule.Settings{VLLMSeed: "1"})
		if err != nil {
			t.Fatal(err)
		}
		if err := reconcileAll(lr, f.g, []control.Service{{ID: 1, Rule: p}}); err != nil {
			t.Fatal(err)
		}
		c := &http.Client{Transport: &http.Transport{TLSClientConfig: &tls.Config{RootCAs: ca.Pool}}}
		resp, err := c.Post("https://"+net.JoinHostPort(tc.vip, strconv.Itoa(port))+"/v1/completions", "application/json", strings.NewReader(`{"model":"m","prompt":"hi"}`))
		if err != nil {
			t.Fatal(err)
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		if resp.StatusCode != tc.wantStatus {
			t.Errorf("client cert %v: status %d, want %d", tc.withCert, resp.StatusCode, tc.wantStatus)
		}
		if n := upstreamTLSErrors(t, reg); (n > 0) == tc.withCert {
			t.Errorf("client cert %v: %v TLS upstream errors counted", tc.withCert, n)
		}
		c.CloseIdleConnections()
		cancel()
		<-done
	}
}

// upstreamTLSErrors sums loxilb_ai_upstream_errors_total{class="tls"}.
func upstreamTLSErrors(t *testing.T, reg *prometheus.Registry) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	sum := 0.0
	for _, mf := range mfs {
		if mf.GetName() != "loxilb_ai_upstream_errors_total" {
			continue
		}
		for _, m := range mf.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == "class" && l.GetValue() == "tls" {
					sum += m.GetCounter().GetValue()
				}
			}
		}
	}
	return sum
}
