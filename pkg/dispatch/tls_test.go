package dispatch

import (
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"testing"
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

	d, err := New(Config{TLS: pre.Client().Transport.(*http.Transport).TLSClientConfig}, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	w := httptest.NewRecorder()
	res := d.Serve(t.Context(), w, req)
	if res.Status != 200 || w.Body.String() != `{"choices":[{"text":" ok"}]}` {
		t.Fatalf("status %d body %s", res.Status, w.Body.String())
	}
	if !strings.Contains(prefillBody, `"do_remote_decode":true`) || !strings.Contains(decodeBody, `"remote_block_ids":[7]`) {
		t.Fatalf("legs: prefill %s decode %s", prefillBody, decodeBody)
	}

	// Without the test CA the handshake fails: a clean 502, not a hang.
	plain, _ := New(Config{}, nil, nil)
	defer plain.Close()
	w = httptest.NewRecorder()
	res = plain.Serve(t.Context(), w, req)
	if res.Status != http.StatusBadGateway || !strings.Contains(w.Body.String(), "certificate") {
		t.Fatalf("unknown CA: status %d body %s", res.Status, w.Body.String())
	}
}
