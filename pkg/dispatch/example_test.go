package dispatch_test

import (
	"fmt"
	"net/http"
	"net/http/httptest"

	"github.com/loxilb-llm/loxilb/pkg/dispatch"
	"github.com/loxilb-llm/loxilb/pkg/proxy"
)

// Serving a P/D pool from an HTTP handler: Serve chooses the endpoints,
// runs the engine's flow over the proxy's upstream and writes the
// response; a stream cut after its status line went out must close the
// client connection. Behind the mode-4 proxy, Request.Legs is the
// proxy.Request's; standing alone, a proxy.Transport.
func Example() {
	d, err := dispatch.New(dispatch.Config{}, nil, nil)
	if err != nil {
		panic(err)
	}
	legs, err := proxy.NewTransport(proxy.Config{}, nil)
	if err != nil {
		panic(err)
	}
	defer legs.CloseIdleConnections()
	pool := &dispatch.Pool{Service: 1, Engine: dispatch.EngineSGLang, BootstrapPort: 0, // 8998
		Prefill: []dispatch.Endpoint{{Idx: 0, Host: "127.0.0.1", Port: 1, Healthy: false}},
		Decode:  []dispatch.Endpoint{{Idx: 1, Host: "127.0.0.1", Port: 2, Healthy: true}}}
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		req := &dispatch.Request{Pool: pool, Method: r.Method, Path: r.URL.Path, Header: r.Header,
			Body: []byte(`{"prompt":"hi"}`), Legs: legs}
		if res := d.Serve(r.Context(), w, req); dispatch.MustAbort(res) {
			panic(http.ErrAbortHandler)
		}
	})
	w := httptest.NewRecorder()
	h.ServeHTTP(w, httptest.NewRequest("POST", "/v1/completions", nil))
	fmt.Println(w.Code, w.Header().Get("Content-Type"))
	// Output: 503 application/json
}
