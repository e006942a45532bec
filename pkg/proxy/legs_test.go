package proxy

import (
	"context"
	"crypto/tls"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"
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
				inflightDuringLeg = px.inflight.Count(7, leg)
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
	if px.inflight.Count(7, 0) != 0 || px.inflight.Count(7, 1) != 0 {
		t.Errorf("in-flight after the legs: %d %d", px.inflight.Count(7, 0), px.inflight.Count(7, 1))
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

// TestDispatchGetsTheRulesLegs: the proxy hands Plan.Dispatch the rule's
// upstream in Request.Legs, so a flow's legs share its pool and count in
// flight without the flow knowing the Server.
func TestDispatchGetsTheRulesLegs(t *testing.T) {
	b, backendConns := echoBackend(t, "leg")
	var px *proxyUnderTest
	var inflight int
	picker := PickerFunc(func(_ context.Context, req *Request) (Plan, error) {
		if req.Legs != nil {
			t.Errorf("the Picker saw Request.Legs set")
		}
		return Plan{Dispatch: func(ctx context.Context, w http.ResponseWriter, r *Request) Result {
			if r.Legs == nil {
				return Result{Err: errors.New("no legs")}
			}
			lreq, _ := http.NewRequestWithContext(WithLeg(ctx, Leg{Endpoint: 3, OwnTimeouts: true}), "POST", "http://"+hostPort(b)+"/leg", strings.NewReader(string(r.Body)))
			resp, err := r.Legs.RoundTrip(lreq)
			if err != nil {
				return Result{Err: err}
			}
			inflight = px.inflight.Count(7, 3)
			w.WriteHeader(resp.StatusCode)
			n, _ := io.Copy(w, resp.Body)
			resp.Body.Close()
			return Result{Endpoint: 3, Status: resp.StatusCode, BytesOut: n}
		}}, nil
	})
	px = startProxy(t, "127.0.0.111", Config{}, Service{}, picker)
	c := newClient()
	for range 2 {
		resp, err := c.Post("http://"+px.addr+"/v1/completions", "application/json", strings.NewReader(`{"model":"m"}`))
		if err != nil {
			t.Fatal(err)
		}
		if e := decodeEcho(t, resp); resp.StatusCode != 200 || e.Path != "/leg" {
			t.Fatalf("status %d echo %+v", resp.StatusCode, e)
		}
	}
	if inflight != 1 || px.inflight.Count(7, 3) != 0 {
		t.Errorf("in flight during the leg %d, after %d", inflight, px.inflight.Count(7, 3))
	}
	if n := backendConns.Load(); n != 1 {
		t.Errorf("two legs opened %d endpoint connections, want 1", n)
	}
}

// TestLegOwnTimeouts: a leg that bounds its own time is not cut by the
// proxy's response header timeout; any other request is.
func TestLegOwnTimeouts(t *testing.T) {
	release := make(chan struct{})
	slow := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		select {
		case <-release:
		case <-r.Context().Done():
		}
		_, _ = io.WriteString(w, "late")
	}))
	t.Cleanup(slow.Close)
	t.Cleanup(func() { close(release) })
	tr, err := NewTransport(Config{ResponseHeaderTimeout: 50 * time.Millisecond}, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(tr.CloseIdleConnections)

	req, _ := http.NewRequest("GET", slow.URL+"/", nil)
	if _, err := tr.RoundTrip(req); !errors.Is(err, ErrUpstreamTimeout) || StatusFor(err) != http.StatusGatewayTimeout {
		t.Fatalf("request without its own bounds: %v", err)
	}

	// The leg's own bound (its context) is the only one: it outlives the
	// proxy's header timeout and ends when the flow cancels it.
	ctx, cancel := context.WithCancel(WithLeg(t.Context(), Leg{Endpoint: -1, OwnTimeouts: true}))
	done := make(chan error, 1)
	go func() {
		req, _ := http.NewRequestWithContext(ctx, "GET", slow.URL+"/", nil)
		_, err := tr.RoundTrip(req)
		done <- err
	}()
	select {
	case err := <-done:
		t.Fatalf("a leg with its own bounds ended before its flow cancelled it: %v", err)
	case <-time.After(300 * time.Millisecond): // six header timeouts
	}
	cancel()
	if err := <-done; err == nil {
		t.Fatal("a cancelled leg succeeded")
	}
}

// TestLegTLSClass: an endpoint certificate a leg cannot verify is the TLS
// class (502 upstream_tls_error), not a protocol error; a leg's dial
// timeout bounds its handshake.
func TestLegTLSClass(t *testing.T) {
	srv := httptest.NewTLSServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {}))
	t.Cleanup(srv.Close)
	tr, err := NewTransport(Config{}, &tls.Config{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(tr.CloseIdleConnections)
	req, _ := http.NewRequestWithContext(WithLeg(t.Context(), Leg{DialTimeout: time.Second}), "GET", "http://"+hostPort(srv)+"/", nil)
	_, err = tr.RoundTrip(req)
	if v := VerdictFor(err); !errors.Is(err, ErrUpstreamTLS) || v.Class != ClassTLS || v.Status != http.StatusBadGateway {
		t.Fatalf("unverifiable endpoint: %v (%+v)", err, v)
	}
	if _, err := NewTransport(Config{DialTimeout: -1}, nil); err == nil {
		t.Fatal("a negative dial timeout was accepted")
	}
}
