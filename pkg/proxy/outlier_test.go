package proxy

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"syscall"
	"testing"

	"github.com/loxilb-llm/loxilb/pkg/outlier"
)

// observing wraps a static picker so every plan reports its attempts.
type observing struct {
	p   *staticPicker
	mu  sync.Mutex
	got []string
}

func (o *observing) Pick(ctx context.Context, req *Request) (Plan, error) {
	plan, err := o.p.Pick(ctx, req)
	plan.Observe = func(ep Endpoint, out outlier.Outcome) {
		o.mu.Lock()
		defer o.mu.Unlock()
		o.got = append(o.got, map[outlier.Outcome]string{outlier.Success: "ok", outlier.GatewayFailure: "gw", outlier.ServerError: "5xx"}[out]+"@"+ep.Addr)
	}
	return plan, err
}

func (o *observing) outcomes() string {
	o.mu.Lock()
	defer o.mu.Unlock()
	return strings.Join(o.got, " ")
}

// TestRetriesBoundedAndObserved: refused connections move on to the next
// candidate at most MaxRetries times, and every attempt is reported.
func TestRetriesBoundedAndObserved(t *testing.T) {
	good, _ := echoBackend(t, "good")
	r1, r2, r3 := refusedAddr(t), refusedAddr(t), refusedAddr(t)
	for _, tc := range []struct {
		name    string
		retries int
		status  int
		want    string
	}{
		{"default two retries", 0, http.StatusBadGateway, "gw@" + r1 + " gw@" + r2 + " gw@" + r3},
		{"three retries reach the good one", 3, 200, "gw@" + r1 + " gw@" + r2 + " gw@" + r3 + " ok@" + hostPort(good)},
		{"no retry", -1, http.StatusBadGateway, "gw@" + r1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			o := &observing{p: newStaticPicker(r1, r2, r3, hostPort(good))}
			px := startProxy(t, "127.0.0.14", Config{MaxRetries: tc.retries}, Service{}, o)
			resp, err := newClient().Post("http://"+px.addr+"/v1/completions", "application/json", strings.NewReader(`{"prompt":"x"}`))
			if err != nil {
				t.Fatal(err)
			}
			resp.Body.Close()
			o.p.waitResult(t)
			if resp.StatusCode != tc.status || o.outcomes() != tc.want {
				t.Fatalf("status %d, outcomes %q; want %d, %q", resp.StatusCode, o.outcomes(), tc.status, tc.want)
			}
		})
	}
}

// TestServerErrorObserved: a 5xx answer is relayed as is and reported as
// a server error, not retried.
func TestServerErrorObserved(t *testing.T) {
	bad := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		http.Error(w, "overloaded", http.StatusServiceUnavailable)
	}))
	t.Cleanup(bad.Close)
	good, _ := echoBackend(t, "good")
	o := &observing{p: newStaticPicker(hostPort(bad), hostPort(good))}
	px := startProxy(t, "127.0.0.14", Config{}, Service{}, o)
	resp, err := newClient().Post("http://"+px.addr+"/v1/completions", "application/json", strings.NewReader(`{"prompt":"x"}`))
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	o.p.waitResult(t)
	if resp.StatusCode != http.StatusServiceUnavailable || o.outcomes() != "5xx@"+hostPort(bad) {
		t.Fatalf("status %d, outcomes %q", resp.StatusCode, o.outcomes())
	}
}

// TestWriteFailureRetryable: a connection that broke while the request was
// written cannot have started it; a reset after that may have.
func TestWriteFailureRetryable(t *testing.T) {
	if _, retry := upstreamError("a:1", fmt.Errorf("%w: %w", errWriteFailed, syscall.ECONNRESET)); !retry {
		t.Error("write failure not retryable")
	}
	if _, retry := upstreamError("a:1", syscall.ECONNRESET); retry {
		t.Error("reset after the request was written is retryable")
	}
	if o := outcomeOf(fmt.Errorf("%w: x", ErrUpstreamProtocol)); o != outlier.GatewayFailure {
		t.Errorf("protocol error outcome %v", o)
	}
	if o := outcomeOf(fmt.Errorf("%w: x", ErrClientCanceled)); o != outlier.Ignore {
		t.Errorf("client cancel outcome %v", o)
	}
}
