package enginesim

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
)

// FuzzRequestBodies feeds arbitrary bodies to every body-taking endpoint of
// each engine: the answer must be a status, never a panic.
func FuzzRequestBodies(f *testing.F) {
	for _, s := range []string{
		`{"prompt": "hi"}`, `{"prompt": [1,2,3], "max_tokens": 2}`, `{"messages": [{"role":"user","content":"x"}]}`,
		`{"messages": [{"role":"user","content":[{"type":"text","text":"a"}]}], "stream": true}`,
		`{"prompt": "x", "kv_transfer_params": {"do_remote_decode": true}}`,
		`{"prompt": "x", "kv_transfer_params": {"do_remote_prefill": true, "remote_host": "", "remote_port": 1}}`,
		`{"prompt": "x", "bootstrap_room": 18446744073709551615}`,
		`{"prompt": "x", "disaggregated_params": {"request_type": "generation_only", "encoded_opaque_state": "e30="}}`,
		`{"drop_prob": 0.5, "restart": true}`, `{"prompt": [[1],[2]]}`, `null`, `[]`, `{"prompt": ["a"]}`,
	} {
		f.Add(s)
	}
	var engines []*Engine
	for _, c := range []Config{
		{Engine: EngineVLLM, Role: RoleDecode}, {Engine: EngineSGLang, Role: RolePrefill},
		{Engine: EngineTRTLLM, Role: RoleDecode}, {Engine: EngineLlamaCpp},
	} {
		c.ZMQPort, c.TimeScale, c.TimeScaleSet, c.PDTimeout, c.MaxModelLen = -1, 0, true, 1, 4096
		e, err := New(c, Deps{HTTPClient: loopbackOnlyClient()})
		if err != nil {
			f.Fatal(err)
		}
		f.Cleanup(func() { e.Close() })
		engines = append(engines, e)
	}
	paths := []string{"/v1/completions", "/v1/chat/completions", "/tokenize", "/sim/fault"}
	f.Fuzz(func(t *testing.T, body string) {
		for _, e := range engines {
			h := e.Handler()
			for _, p := range paths {
				rec := httptest.NewRecorder()
				h.ServeHTTP(rec, httptest.NewRequest(http.MethodPost, p, strings.NewReader(body)))
				if rec.Code == 0 {
					t.Fatalf("%s %s: no status", e.cfg.Engine, p)
				}
			}
			_ = e.SetFaults(Faults{})
		}
	})
}

// loopbackOnlyClient refuses to dial anything but 127.0.0.0/8, so fuzzed
// prefill addresses cannot reach the network.
func loopbackOnlyClient() *http.Client {
	d := &net.Dialer{}
	return &http.Client{Transport: &http.Transport{
		DialContext: func(ctx context.Context, network, addr string) (net.Conn, error) {
			host, _, err := net.SplitHostPort(addr)
			if err != nil {
				return nil, err
			}
			if ip := net.ParseIP(host); ip == nil || !ip.IsLoopback() {
				return nil, fmt.Errorf("test refuses to dial %s", addr)
			}
			return d.DialContext(ctx, network, addr)
		},
	}}
}
