package proxy

import (
	"context"
	"crypto/tls"
	"fmt"
	"io"
	"net/http"
	"time"
)

// RoundTripper returns an http.RoundTripper for flows that run their own
// upstream legs (Plan.Dispatch, e.g. prefill then decode). It sends each
// request over the service's pooled endpoint connections, with the
// service's upstream TLS settings (security 2), and counts it in the
// endpoint's in-flight number (InFlightTable) when the request context
// names the endpoint index via WithLeg or WithEndpoint, so the router's
// load blend sees those legs too. The Server hands the same RoundTripper
// to every Plan.Dispatch in Request.Legs.
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

// Leg describes one leg of a flow to the RoundTripper (see WithLeg).
type Leg struct {
	// Endpoint is the index the leg is counted under in the InFlightTable
	// while it runs; negative means not counted.
	Endpoint int
	// DialTimeout bounds the connect and the TLS handshake; 0 means
	// Config.DialTimeout.
	DialTimeout time.Duration
	// OwnTimeouts says the flow bounds the response itself (through the
	// request context): Config.ResponseHeaderTimeout and
	// StreamIdleTimeout do not apply to the leg.
	OwnTimeouts bool
}

type legKey struct{}

// WithLeg returns a context describing the leg a request is, for the
// RoundTripper.
func WithLeg(ctx context.Context, l Leg) context.Context {
	return context.WithValue(ctx, legKey{}, l)
}

// WithEndpoint returns a context naming the endpoint index a leg is sent
// to, for in-flight accounting by the RoundTripper.
func WithEndpoint(ctx context.Context, ep int) context.Context {
	return WithLeg(ctx, Leg{Endpoint: ep})
}

type legTripper struct {
	s       *Server
	service uint32
	svc     *service // when set, the service the Server handed the flow
}

func (lt legTripper) RoundTrip(req *http.Request) (*http.Response, error) {
	svc := lt.svc
	if svc == nil {
		for _, c := range lt.s.table.Load().list {
			if c.cfg.ID == lt.service {
				svc = c
				break
			}
		}
	}
	if svc == nil {
		return nil, fmt.Errorf("%w: service %d", ErrNoService, lt.service)
	}
	leg, named := req.Context().Value(legKey{}).(Leg)
	if !named || leg.Endpoint < 0 {
		return legRoundTrip(svc.up, req, leg)
	}
	c := lt.s.inflight.Counter(lt.service, leg.Endpoint)
	c.Add(1)
	// Counted until the body is finished, like the proxy's own relay.
	resp, err := legRoundTrip(svc.up, req, leg)
	if err != nil {
		c.Add(-1)
		return nil, err
	}
	resp.Body = &countedBody{rc: resp.Body, done: func() { c.Add(-1) }}
	return resp, nil
}

// legRoundTrip sends one leg over u and wraps a failure with the proxy's
// sentinel for it.
func legRoundTrip(u *upstream, req *http.Request, leg Leg) (*http.Response, error) {
	lim := u.lim
	if leg.DialTimeout > 0 {
		lim.dial = leg.DialTimeout
	}
	if leg.OwnTimeouts {
		lim.header, lim.idle = 0, 0
	}
	addr := req.URL.Host
	resp, err := u.sendWithin(req.Context(), addr, &stdRequest{req: req}, req, req.Close, lim)
	if err != nil {
		wrapped, _ := upstreamError(addr, err)
		return nil, wrapped
	}
	return resp, nil
}

// Transport is the proxy's upstream without a Server: pooled endpoint
// connections and the proxy's error classes for flows run outside the
// mode-4 listener (tests, benchmarks, tools). A Server's flows get theirs
// in Request.Legs. Legs are not counted in any in-flight number. It is
// safe for concurrent use.
type Transport struct{ up *upstream }

var _ http.RoundTripper = (*Transport)(nil)

// NewTransport returns a Transport with cfg's upstream settings (dial and
// response timeouts, header limit, pool size); tlsConf, when not nil,
// makes every connection TLS (security 2).
func NewTransport(cfg Config, tlsConf *tls.Config) (*Transport, error) {
	cfg = cfg.withDefaults()
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	return &Transport{up: newUpstream(cfg, tlsConf)}, nil
}

// RoundTrip implements http.RoundTripper like Server.RoundTripper does.
func (t *Transport) RoundTrip(req *http.Request) (*http.Response, error) {
	leg, _ := req.Context().Value(legKey{}).(Leg)
	return legRoundTrip(t.up, req, leg)
}

// CloseIdleConnections closes the pooled connections.
func (t *Transport) CloseIdleConnections() { t.up.closeIdle(false) }

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

// RemoveHopHeaders deletes the hop-by-hop fields of h and the ones its
// Connection field names (RFC 9110 §7.6.1), as the proxy does for the
// requests and responses it relays itself: a flow running its own legs
// calls it on each leg's request header and on the response header it
// relays.
func RemoveHopHeaders(h http.Header) { removeHop(h) }
