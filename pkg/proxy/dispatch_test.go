package proxy

import (
	"context"
	"errors"
	"io"
	"net/http"
	"strings"
	"testing"
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
