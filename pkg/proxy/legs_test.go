package proxy

import (
	"context"
	"errors"
	"io"
	"net/http"
	"strings"
	"testing"
)

// TestRoundTripperForDispatchLegs runs a two-leg flow through
// Plan.Dispatch over the proxy's own pool: in-flight counts cover the
// legs, connections are reused, and errors carry the proxy's sentinels.
func TestRoundTripperForDispatchLegs(t *testing.T) {
	b, backendConns := echoBackend(t, "leg")
	var px *proxyUnderTest
	var inflightDuringLeg int
	picker := PickerFunc(func(_ context.Context, req *Request) (Plan, error) {
		return Plan{Dispatch: func(ctx context.Context, w http.ResponseWriter, r *Request) Result {
			rt := px.RoundTripper(7)
			for leg := range 2 {
				lreq, _ := http.NewRequestWithContext(WithEndpoint(ctx, leg), "POST", "http://"+hostPort(b)+"/leg", strings.NewReader(string(r.Body)))
				resp, err := rt.RoundTrip(lreq)
				if err != nil {
					return Result{Endpoint: leg, Err: err}
				}
				inflightDuringLeg = px.InFlight(7, leg)
				if leg == 0 {
					_, _ = io.Copy(io.Discard, resp.Body)
					resp.Body.Close()
					continue
				}
				w.WriteHeader(resp.StatusCode)
				n, _ := io.Copy(w, resp.Body)
				resp.Body.Close()
				return Result{Endpoint: leg, Status: resp.StatusCode, BytesOut: n}
			}
			return Result{}
		}}, nil
	})
	px = startProxy(t, "127.0.0.110", Config{}, Service{}, picker)
	c := newClient()
	for range 3 {
		resp, err := c.Post("http://"+px.addr+"/v1/completions", "application/json", strings.NewReader(`{"model":"m"}`))
		if err != nil {
			t.Fatal(err)
		}
		if e := decodeEcho(t, resp); resp.StatusCode != 200 || e.Body != `{"model":"m"}` || e.Path != "/leg" {
			t.Fatalf("status %d echo %+v", resp.StatusCode, e)
		}
	}
	if inflightDuringLeg != 1 {
		t.Errorf("in-flight during a leg = %d, want 1", inflightDuringLeg)
	}
	if px.InFlight(7, 0) != 0 || px.InFlight(7, 1) != 0 {
		t.Errorf("in-flight after the legs: %d %d", px.InFlight(7, 0), px.InFlight(7, 1))
	}
	if n := backendConns.Load(); n != 1 {
		t.Errorf("legs opened %d endpoint connections for 6 sequential legs, want 1", n)
	}

	lreq, _ := http.NewRequest("GET", "http://"+refusedAddr(t)+"/", nil)
	if _, err := px.RoundTripper(7).RoundTrip(lreq); !errors.Is(err, ErrUpstreamConnect) || StatusFor(err) != 502 {
		t.Errorf("refused leg: %v", err)
	}
	if _, err := px.RoundTripper(99).RoundTrip(lreq); !errors.Is(err, ErrNoService) {
		t.Errorf("unknown service: %v", err)
	}
}
