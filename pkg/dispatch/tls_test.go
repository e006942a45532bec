package dispatch

import (
	"crypto/tls"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"testing"

	"github.com/loxilb-llm/loxilb/pkg/proxy"
	"github.com/prometheus/client_golang/prometheus"
)

// TestHTTPSPool (security 2): both legs go over TLS with the configured
// roots, and an endpoint with an unknown certificate fails cleanly.
func TestHTTPSPool(t *testing.T) {
	var prefillBody string
	pre := httptest.NewTLSServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		prefillBody = string(b)
		w.Header().Set("Content-Type", "application/json")
		_, _ = w.Write([]byte(`{"kv_transfer_params":{"do_remote_prefill":true,"remote_block_ids":[7],"remote_engine_id":"e"}}`))
	}))
	defer pre.Close()
	var decodeBody string
	dec := httptest.NewTLSServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		decodeBody = string(b)
		w.Header().Set("Content-Type", "application/json")
		_, _ = w.Write([]byte(`{"choices":[{"text":" ok"}]}`))
	}))
	defer dec.Close()
	ep := func(s *httptest.Server, idx int) Endpoint {
		h, p, _ := net.SplitHostPort(s.Listener.Addr().String())
		n, _ := strconv.Atoi(p)
		return Endpoint{Idx: idx, Host: h, Port: n, Healthy: true}
	}
	pool := &Pool{Service: 3, Engine: EngineVLLM, Scheme: "https", Prefill: []Endpoint{ep(pre, 0)}, Decode: []Endpoint{ep(dec, 1)}}
	req := &Request{Pool: pool, Method: "POST", Path: "/v1/completions", Header: http.Header{}, Body: []byte(`{"prompt":"hi","max_tokens":3}`)}

	d, err := New(Config{}, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	req.Legs = newLegs(t, proxy.Config{}, pre.Client().Transport.(*http.Transport).TLSClientConfig)
	w := httptest.NewRecorder()
	res := d.Serve(t.Context(), w, req)
	if res.Status != 200 || w.Body.String() != `{"choices":[{"text":" ok"}]}` {
		t.Fatalf("status %d body %s", res.Status, w.Body.String())
	}
	if !strings.Contains(prefillBody, `"do_remote_decode":true`) || !strings.Contains(decodeBody, `"remote_block_ids":[7]`) {
		t.Fatalf("legs: prefill %s decode %s", prefillBody, decodeBody)
	}

	// Without the test CA the handshake fails: a clean 502, not a hang.
	req.Legs = newLegs(t, proxy.Config{}, &tls.Config{})
	w = httptest.NewRecorder()
	res = d.Serve(t.Context(), w, req)
	if res.Status != http.StatusBadGateway || !strings.Contains(w.Body.String(), "certificate") {
		t.Fatalf("unknown CA: status %d body %s", res.Status, w.Body.String())
	}
}

// TestLegTLSFailureClass: a leg whose endpoint certificate cannot be
// verified is the proxy's TLS class (502 upstream_tls_error), counted
// under class tls, and is not retried on another prefill endpoint as a
// refused connect would be.
func TestLegTLSFailureClass(t *testing.T) {
	pre := httptest.NewTLSServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {}))
	defer pre.Close()
	h, p, _ := net.SplitHostPort(pre.Listener.Addr().String())
	n, _ := strconv.Atoi(p)
	pool := &Pool{Service: 3, Engine: EngineVLLM, Scheme: "https",
		Prefill: []Endpoint{{Idx: 0, Host: h, Port: n, Healthy: true}}, Decode: []Endpoint{{Idx: 1, Host: h, Port: n, Healthy: true}}}
	reg := prometheus.NewRegistry()
	d, err := New(Config{}, nil, reg)
	if err != nil {
		t.Fatal(err)
	}
	req := &Request{Pool: pool, Method: "POST", Path: "/v1/completions", Header: http.Header{}, Body: []byte(`{"prompt":"hi"}`),
		Legs: newLegs(t, proxy.Config{}, &tls.Config{})}
	w := httptest.NewRecorder()
	res := d.Serve(t.Context(), w, req)
	if res.Status != http.StatusBadGateway || res.Class != proxy.ClassTLS || !strings.Contains(w.Body.String(), `"code":"upstream_tls_error"`) {
		t.Fatalf("status %d class %q body %s", res.Status, res.Class, w.Body.String())
	}
	if got := metricSum(t, reg, "loxilb_ai_pd_leg_errors_total", "leg", "prefill", "class", "tls"); got != 1 {
		t.Fatalf("tls leg errors %v", got)
	}
}

// TestNoLegsIsAnInternalError: a request without the proxy's upstream is
// a wiring bug, answered 500 before any leg, never a panic.
func TestNoLegsIsAnInternalError(t *testing.T) {
	d, err := New(Config{}, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	pool := &Pool{Service: 3, Engine: EngineVLLM,
		Prefill: []Endpoint{{Idx: 0, Host: "127.0.0.1", Port: 1, Healthy: true}}, Decode: []Endpoint{{Idx: 1, Host: "127.0.0.1", Port: 2, Healthy: true}}}
	w := httptest.NewRecorder()
	res := d.Serve(t.Context(), w, &Request{Pool: pool, Method: "POST", Path: "/v1/completions", Header: http.Header{}, Body: []byte(`{}`)})
	if res.Status != http.StatusInternalServerError || w.Code != http.StatusInternalServerError || res.Class != proxy.ClassInternal {
		t.Fatalf("status %d class %q body %s", res.Status, res.Class, w.Body.String())
	}
}
