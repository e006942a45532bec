package dispatch

import (
	"bytes"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"testing"

	"github.com/loxilb-llm/loxilb/pkg/proxy"
)

func benchBody() []byte {
	var sb strings.Builder
	for i := 0; i < 100; i++ {
		fmt.Fprintf(&sb, "Paragraph %d of a long shared system prompt. ", i)
	}
	b := fmt.Sprintf(`{"model":"m","max_tokens":64,"stream":true,"messages":[{"role":"system","content":%q},{"role":"user","content":"question?"}]}`, sb.String())
	return []byte(b)
}

// BenchmarkChoose is the ladder for one request over 4+4 endpoints with a
// warm prefix history (the prompt-chunk keys are computed per request).
func BenchmarkChoose(b *testing.B) {
	d, _ := New(Config{}, nil, nil)
	pool := &Pool{Service: 1, Engine: EngineVLLM}
	for i := 0; i < 4; i++ {
		pool.Prefill = append(pool.Prefill, Endpoint{Idx: i, Host: "127.0.0.1", Port: 1, Healthy: true})
		pool.Decode = append(pool.Decode, Endpoint{Idx: 4 + i, Host: "127.0.0.1", Port: 1, Healthy: true})
	}
	body := benchBody()
	req := &Request{Pool: pool, Body: body, Header: http.Header{}}
	c, _ := d.Choose(req)
	d.trie.insert(1, c.keys, 2)
	b.SetBytes(int64(len(body)))
	b.ReportAllocs()
	for b.Loop() {
		if _, err := d.Choose(req); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkVLLMRewrite is the body work of one vLLM request: parse, the
// prefill rewrite, the params splice and the decode body.
func BenchmarkVLLMRewrite(b *testing.B) {
	body := benchBody()
	resp := []byte(`{"id":"x","choices":[{"text":" a"}],"kv_transfer_params":{"do_remote_prefill":true,"do_remote_decode":false,"remote_block_ids":[0,1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17,18,19,20,21,22,23,24,25,26,27,28,29,30,31,32,33,34,35,36,37,38,39,40,41,42,43,44,45,46,47,48,49,50,51,52,53,54,55,56,57,58,59,60,61,62,63],"remote_engine_id":"0f0e6c1e-7d7b-4c5c-9e3f-6a8f1b7c2d4e","remote_request_id":"r","remote_host":"10.0.0.1","remote_port":5600,"tp_size":1}}`)
	ep := Endpoint{Host: "127.0.0.1", Port: 8000}
	b.SetBytes(int64(len(body)))
	b.ReportAllocs()
	for b.Loop() {
		m, err := parseBody(body)
		if err != nil {
			b.Fatal(err)
		}
		_ = vllmPrefillBody(m)
		p, _, err := vllmParams(resp, ep, 1<<16)
		if err != nil {
			b.Fatal(err)
		}
		db := cloneBody(m)
		db["kv_transfer_params"] = p
		_ = encodeBody(db)
	}
}

// BenchmarkVLLMFlowLoopback is a whole vLLM P/D request over loopback
// against minimal in-process engines: the dispatcher's cost per request
// (two legs, pooled connections), without engine compute.
func BenchmarkVLLMFlowLoopback(b *testing.B) {
	pre := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		w.Header().Set("Content-Type", "application/json")
		_, _ = w.Write([]byte(`{"choices":[{"text":" a","finish_reason":"length"}],"kv_transfer_params":{"do_remote_prefill":true,"remote_block_ids":[1,2,3],"remote_engine_id":"e"}}`))
	}))
	defer pre.Close()
	dec := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		w.Header().Set("Content-Type", "text/event-stream")
		for i := 0; i < 4; i++ {
			_, _ = w.Write([]byte("data: {\"choices\":[{\"text\":\" x\"}]}\n\n"))
			w.(http.Flusher).Flush()
		}
		_, _ = w.Write([]byte("data: [DONE]\n\n"))
	}))
	defer dec.Close()
	ep := func(s *httptest.Server, idx int) Endpoint {
		h, p, _ := net.SplitHostPort(s.Listener.Addr().String())
		n, _ := strconv.Atoi(p)
		return Endpoint{Idx: idx, Host: h, Port: n, Healthy: true}
	}
	d, _ := New(Config{}, nil, nil)
	legs := newLegs(b, proxy.Config{}, nil)
	pool := &Pool{Service: 1, Engine: EngineVLLM, Prefill: []Endpoint{ep(pre, 0)}, Decode: []Endpoint{ep(dec, 1)}}
	body := benchBody()
	b.ReportAllocs()
	for b.Loop() {
		w := httptest.NewRecorder()
		res := d.Serve(b.Context(), w, &Request{Pool: pool, Method: "POST", Path: "/v1/chat/completions", Header: http.Header{}, Body: body, Legs: legs})
		if res.Status != 200 || !bytes.Contains(w.Body.Bytes(), []byte("[DONE]")) {
			b.Fatalf("status %d: %s", res.Status, w.Body.Bytes())
		}
	}
}
