package proxy

import (
	"context"
	"errors"
	"io"
	"net/http"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus/testutil"
)

// TestDispatchHook: a plan with its own flow (prefill/decode) writes the
// response itself; the proxy records the outcome and calls Done once.
func TestDispatchHook(t *testing.T) {
	var done []Result
	var sawBody string
	mode := "ok"
	picker := PickerFunc(func(_ context.Context, req *Request) (Plan, error) {
		return Plan{Receipt: "tier=pd ep=1", Done: func(r Result) { done = append(done, r) },
			Dispatch: func(_ context.Context, w http.ResponseWriter, r *Request) Result {
				sawBody = string(r.Body)
				switch mode {
				case "nothing":
					return Result{Endpoint: 1, Err: errors.Join(ErrUnavailable, errors.New("prefill leg failed"))}
				}
				w.Header().Set("Content-Type", "application/json")
				w.WriteHeader(http.StatusOK)
				n, _ := io.WriteString(w, `{"ok":true}`)
				return Result{Endpoint: 2, Status: http.StatusOK, BytesOut: int64(n)}
			}}, nil
	})
	p := startProxy(t, "127.0.0.1", Config{}, Service{Receipts: ReceiptsOnRequest}, picker)
	cl := newClient()
	req, _ := http.NewRequest(http.MethodPost, "http://"+p.addr+"/v1/completions", strings.NewReader(`{"model":"m","prompt":"p"}`))
	req.Header.Set(HeaderReceiptRequest, "1")
	resp, err := cl.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 200 || string(b) != `{"ok":true}` || resp.Header.Get(HeaderRoute) != "tier=pd ep=1" || sawBody != `{"model":"m","prompt":"p"}` {
		t.Fatalf("dispatch response: %d %q %q body seen %q", resp.StatusCode, b, resp.Header.Get(HeaderRoute), sawBody)
	}
	if len(done) != 1 || done[0].Endpoint != 2 || done[0].BytesIn == 0 {
		t.Fatalf("Done: %+v", done)
	}
	mode = "nothing"
	resp, err = cl.Post("http://"+p.addr+"/v1/completions", "application/json", strings.NewReader(`{}`))
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusServiceUnavailable || len(done) != 2 || done[1].Status != http.StatusServiceUnavailable {
		t.Fatalf("a flow that wrote nothing must become the error answer: %d %+v", resp.StatusCode, done)
	}
}

// TestDispatchWriterEdges: what a flow writes is read like a relay in its
// less common shapes: a body written without WriteHeader (an implicit 200)
// still fires FirstByte and is scanned; usage the flow reported itself is
// kept, not overwritten; an SSE body's last usage event is the one counted.
func TestDispatchWriterEdges(t *testing.T) {
	var (
		firstBytes int
		done       []Result
		mode       string
	)
	picker := PickerFunc(func(context.Context, *Request) (Plan, error) {
		return Plan{FirstByte: func() { firstBytes++ }, Done: func(r Result) { done = append(done, r) },
			Dispatch: func(_ context.Context, w http.ResponseWriter, _ *Request) Result {
				res := Result{Endpoint: 4, Status: http.StatusOK}
				switch mode {
				case "implicit":
					w.Header().Set("Content-Type", "application/json")
					io.WriteString(w, `{"usage":{"prompt_tokens":9,"prompt_tokens_details":{"cached_tokens":8}}}`)
				case "own":
					w.Header().Set("Content-Type", "application/json")
					w.WriteHeader(http.StatusOK)
					io.WriteString(w, `{"usage":{"prompt_tokens":9}}`)
					res.HasUsage, res.PromptTokens = true, 5
				case "sse":
					w.Header().Set("Content-Type", "text/event-stream")
					w.WriteHeader(http.StatusOK)
					w.(http.Flusher).Flush()
					io.WriteString(w, "data: {\"usage\":{\"prompt_tokens\":1}}\n\n")
					io.WriteString(w, "data: {\"usage\":{\"prompt_tokens\":3}}\n\ndata: [DONE]\n\n")
				}
				return res
			}}, nil
	})
	p := startProxy(t, "127.0.0.1", Config{}, Service{}, picker)
	cl := newClient()
	for i, c := range []struct {
		mode           string
		prompt, cached int64
	}{{"implicit", 9, 8}, {"own", 5, 0}, {"sse", 3, 0}} {
		mode = c.mode
		resp, err := cl.Post("http://"+p.addr+"/v1/completions", "application/json", strings.NewReader(`{}`))
		if err != nil {
			t.Fatal(err)
		}
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		if resp.StatusCode != 200 || firstBytes != i+1 || len(done) != i+1 {
			t.Fatalf("%s: status %d, FirstByte %d times, Done %d times", c.mode, resp.StatusCode, firstBytes, len(done))
		}
		if r := done[i]; !r.HasUsage || r.PromptTokens != c.prompt || r.CachedTokens != c.cached {
			t.Fatalf("%s: usage %+v, want prompt %d cached %d", c.mode, r, c.prompt, c.cached)
		}
	}
	if got := testutil.ToFloat64(p.m.usageSeen.WithLabelValues("7", "4", "yes")); got != 1 {
		t.Errorf("usage with cached_tokens counted %v times under ep 4, want 1", got)
	}
	if got := testutil.ToFloat64(p.m.usageSeen.WithLabelValues("7", "4", "no")); got != 2 {
		t.Errorf("usage without cached_tokens counted %v times under ep 4, want 2", got)
	}
}
