package proxy

import (
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"
)

// Plan.FirstByte fires once, when the first body byte of the endpoint's
// response arrives: not at the response headers an SSE engine flushes
// before its prefill, and not again for later chunks.
func TestFirstByteHookFiresOnceAtFirstBodyByte(t *testing.T) {
	headersOut := make(chan struct{})
	sendBody := make(chan struct{})
	b := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		w.WriteHeader(200)
		w.(http.Flusher).Flush()
		close(headersOut)
		select {
		case <-sendBody:
		case <-r.Context().Done():
			return
		}
		for _, c := range []string{"Hel", "lo"} {
			io.WriteString(w, "data: {\"choices\":[{\"text\":\""+c+"\"}]}\n\n")
			w.(http.Flusher).Flush()
		}
		io.WriteString(w, "data: [DONE]\n\n")
	}))
	defer b.Close()
	sp := newStaticPicker(hostPort(b))
	var fired atomic.Int32
	picker := PickerFunc(func(ctx context.Context, req *Request) (Plan, error) {
		p, err := sp.Pick(ctx, req)
		p.FirstByte = func() { fired.Add(1) }
		return p, err
	})
	px := startProxy(t, "127.0.0.33", Config{}, Service{}, picker)

	type answer struct {
		body string
		err  error
	}
	got := make(chan answer, 1)
	go func() {
		resp, err := newClient().Post("http://"+px.addr+"/v1/completions", "application/json", strings.NewReader(`{"model":"m","stream":true}`))
		if err != nil {
			got <- answer{err: err}
			return
		}
		defer resp.Body.Close()
		body, err := io.ReadAll(resp.Body)
		got <- answer{string(body), err}
	}()
	select {
	case <-headersOut:
	case <-time.After(30 * time.Second): // a hang guard, not a performance limit
		t.Fatal("the request never reached the endpoint")
	}
	if n := fired.Load(); n != 0 {
		t.Fatalf("FirstByte fired %d times on response headers alone", n)
	}
	close(sendBody)
	a := <-got
	if a.err != nil || !strings.Contains(a.body, "lo") {
		t.Fatalf("body %q, err %v", a.body, a.err)
	}
	sp.waitResult(t)
	if n := fired.Load(); n != 1 {
		t.Fatalf("FirstByte fired %d times, want 1", n)
	}
}
