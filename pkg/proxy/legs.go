package proxy

import (
	"context"
	"fmt"
	"io"
	"net/http"
)

// RoundTripper returns an http.RoundTripper for flows that run their own
// upstream legs (Plan.Dispatch, e.g. prefill then decode). It sends each
// request over the service's pooled endpoint connections, with the
// service's upstream TLS settings (security 2), and counts it in the
// endpoint's in-flight number (Server.InFlight) when the request context
// names the endpoint index via WithEndpoint, so the router's load blend
// sees those legs too.
//
// req.URL.Host is the endpoint's host:port; req.URL.Scheme is ignored
// (the rule's security level decides). A request with a body should set
// GetBody so it can be replayed on a fresh connection when a pooled one
// turns out dead before anything was sent. Errors wrap the proxy's
// sentinels (ErrUpstreamConnect, ErrUpstreamTLS, ErrUpstreamTimeout,
// ErrUpstreamProtocol), so StatusFor maps them like the proxy's own.
// The response body must be read to its end or closed. The service is
// looked up on every call, so the RoundTripper follows Update; a service
// that no longer exists fails with ErrNoService.
func (s *Server) RoundTripper(service uint32) http.RoundTripper {
	return legTripper{s: s, service: service}
}

type legTripper struct {
	s       *Server
	service uint32
}

func (lt legTripper) RoundTrip(req *http.Request) (*http.Response, error) {
	var svc *service
	for _, c := range lt.s.table.Load().list {
		if c.cfg.ID == lt.service {
			svc = c
			break
		}
	}
	if svc == nil {
		return nil, fmt.Errorf("%w: service %d", ErrNoService, lt.service)
	}
	addr := req.URL.Host
	idx, counted := req.Context().Value(endpointKey{}).(int)
	if counted {
		c := lt.s.inflightCounter(lt.service, idx)
		c.Add(1)
		// Counted until the body is finished, like the proxy's own relay.
		resp, err := lt.roundTrip(svc, req, addr)
		if err != nil {
			c.Add(-1)
			return nil, err
		}
		resp.Body = &countedBody{rc: resp.Body, done: func() { c.Add(-1) }}
		return resp, nil
	}
	return lt.roundTrip(svc, req, addr)
}

func (lt legTripper) roundTrip(svc *service, req *http.Request, addr string) (*http.Response, error) {
	resp, err := svc.up.roundTrip(req, addr)
	if err != nil {
		wrapped, _ := upstreamError(addr, err)
		return nil, wrapped
	}
	return resp, nil
}

// countedBody releases the in-flight count once, when the body ends.
type countedBody struct {
	rc   io.ReadCloser
	done func()
}

func (b *countedBody) Read(p []byte) (int, error) {
	n, err := b.rc.Read(p)
	if err != nil && b.done != nil {
		b.done()
		b.done = nil
	}
	return n, err
}

func (b *countedBody) Close() error {
	if b.done != nil {
		b.done()
		b.done = nil
	}
	return b.rc.Close()
}

type endpointKey struct{}

// WithEndpoint returns a context naming the endpoint index a leg is sent
// to, for in-flight accounting by the RoundTripper.
func WithEndpoint(ctx context.Context, ep int) context.Context {
	return context.WithValue(ctx, endpointKey{}, ep)
}
