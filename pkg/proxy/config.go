package proxy

import (
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"net/http"
	"net/netip"
	"os"
	"path"
	"time"
)

// Security is a mode-4 rule's TLS level (serviceArguments.security).
type Security uint8

// Security levels, numbered as in loxilb rules.
const (
	// SecurityPlain is plaintext on both sides.
	SecurityPlain Security = 0
	// SecurityTLS terminates TLS at the proxy and talks plaintext to endpoints.
	SecurityTLS Security = 1
	// SecurityE2ETLS terminates TLS and opens a new TLS session to the
	// endpoint, verifying its certificate unless explicitly told not to.
	SecurityE2ETLS Security = 2
)

// Defaults applied by Config.withDefaults for zero fields.
const (
	DefaultMaxBodyBytes           = 32 << 20
	DefaultReadHeaderTimeout      = 10 * time.Second
	DefaultBodyReadTimeout        = 60 * time.Second
	DefaultIdleTimeout            = 120 * time.Second
	DefaultDialTimeout            = 5 * time.Second
	DefaultResponseHeaderTimeout  = 300 * time.Second
	DefaultStreamIdleTimeout      = 60 * time.Second
	DefaultUpstreamIdleTimeout    = 90 * time.Second
	DefaultMaxIdleConnsPerHost    = 256
	DefaultShutdownGrace          = 10 * time.Second
	DefaultUsageScanBytes         = 1 << 20
	DefaultMaxInflightBodyBytes   = 256 << 20
	DefaultMaxConnsPerListener    = 10000
	DefaultMaxResponseHeaderBytes = 1 << 20
	DefaultMaxRetries             = 2
)

// Config is the proxy's whole configuration: process-wide knobs plus one
// Service per mode-4 rule. The zero value of every duration and size
// field selects its default.
type Config struct {
	// Services lists the mode-4 rules. Each needs a distinct ID and a
	// distinct Listen address.
	Services []Service

	// MaxBodyBytes bounds the request body the proxy reads (and the
	// Picker sees); larger bodies get 413. Default 32 MiB.
	MaxBodyBytes int64
	// ReadHeaderTimeout bounds reading a client's request headers.
	// It, IdleTimeout, ResponseHeaderTimeout and StreamIdleTimeout are
	// coarse (deadline.go): each may fire up to a sixteenth of its
	// duration late, never early, so a busy connection does not update a
	// runtime timer on every request.
	ReadHeaderTimeout time.Duration
	// BodyReadTimeout bounds reading a client's request body. It is set
	// per request and cleared afterwards, because a connection-wide read
	// deadline would cut long streaming responses.
	BodyReadTimeout time.Duration
	// IdleTimeout closes idle client keep-alive connections.
	IdleTimeout time.Duration
	// DialTimeout bounds connecting (and the TLS handshake) to an endpoint.
	DialTimeout time.Duration
	// ResponseHeaderTimeout bounds the wait for an endpoint's response
	// headers after the request was sent, and then for the first body
	// byte (an engine streaming SSE sends its headers at once and its
	// first event only after prefill). Default 300s: prefill of a long
	// prompt behind a busy engine's queue can take minutes, and a longer
	// wait is indistinguishable from a hung engine for the client.
	ResponseHeaderTimeout time.Duration
	// StreamIdleTimeout cuts a response whose endpoint sent no byte for
	// this long once the body started. Default 60s, like the P/D decode
	// leg's LLB_PD_DECODE_IDLE_SEC: decode steps take milliseconds, and
	// even a preempted sequence resumes within seconds.
	StreamIdleTimeout time.Duration
	// MaxResponseHeaderBytes bounds an endpoint's response headers (status
	// line included), as MaxHeaderBytes does a client's; larger ones get
	// 502. Default 1 MiB.
	MaxResponseHeaderBytes int
	// MaxInflightBodyBytes bounds the memory all request bodies being read
	// or relayed hold together. Buffers grow as bytes arrive, never to a
	// declared Content-Length up front; a request that would exceed the
	// bound gets 503 with Retry-After. Default 256 MiB.
	MaxInflightBodyBytes int64
	// AbortOnClientClose cancels a request as soon as its client ends its
	// sending side (TCP FIN), which is how most clients give up, freeing
	// the endpoint at once. The default (false) keeps serving such a
	// request: a client that only half-closed after its request still
	// reads the answer, and TCP cannot tell the two apart until the
	// proxy writes. A client whose connection resets or fails a write is
	// treated as gone either way. Like HAProxy's "option abortonclose".
	AbortOnClientClose bool
	// ReusePort binds each VIP:port with SO_REUSEPORT, so several
	// gateway nodes on one host (sharing one rule store) all serve it and
	// the kernel spreads new connections over them. Off by default: a
	// lone daemon must see a VIP:port another process holds as in use.
	// Fixed at New.
	ReusePort bool
	// MaxConnsPerListener bounds the client connections open on one
	// listener; connections beyond it are closed at accept. Default 10000.
	MaxConnsPerListener int
	// UpstreamIdleTimeout closes idle pooled endpoint connections.
	UpstreamIdleTimeout time.Duration
	// MaxIdleConnsPerHost sizes the keep-alive pool per endpoint.
	MaxIdleConnsPerHost int
	// MaxRetries bounds how many further candidates a request is sent to
	// after an attempt that failed before the endpoint could have started
	// it (connect refused or timed out, TLS handshake, connection broken
	// while the request was written). A request an endpoint may have
	// started is never sent again. 0 means DefaultMaxRetries; negative
	// means no retry.
	MaxRetries int
	// ShutdownGrace is how long Serve waits for in-flight requests when
	// its context is cancelled before closing them.
	ShutdownGrace time.Duration
	// UsageScanBytes bounds the bytes kept to find usage in a JSON
	// response or in one SSE line. Larger documents are relayed intact
	// but their usage is not extracted.
	UsageScanBytes int
}

// Service is one mode-4 rule as the proxy sees it.
type Service struct {
	// ID is the rule (service) number; it labels metrics and is passed
	// to the Picker.
	ID uint32
	// Listen is the VIP:port the rule listens on.
	Listen netip.AddrPort
	// Security selects plaintext, TLS termination, or TLS on both legs.
	Security Security
	// CertFile and KeyFile hold the PEM certificate chain and key served
	// to clients; required for SecurityTLS and SecurityE2ETLS.
	CertFile, KeyFile string
	// CAFile holds PEM CA certificates that endpoint certificates are
	// verified against (SecurityE2ETLS). Empty means the system roots.
	CAFile string
	// ClientCertFile and ClientKeyFile, if set, are presented to
	// endpoints (mutual TLS, SecurityE2ETLS).
	ClientCertFile, ClientKeyFile string
	// ClientAuth asks clients for a certificate at the VIP (SecurityTLS
	// and SecurityE2ETLS), verified against ClientCAFile and ClientCAPEM.
	ClientAuth ClientAuth
	// ClientCAFile and ClientCAPEM hold the PEM CA certificates client
	// certificates are verified against; at least one is required when
	// ClientAuth is not ClientAuthOff.
	ClientCAFile string
	ClientCAPEM  []byte
	// ClientCNPattern, if set, is a path.Match glob a client
	// certificate's subject CN must match; it also makes a certificate
	// required.
	ClientCNPattern string
	// UpstreamServerName overrides the name verified in endpoint
	// certificates; by default it is the endpoint's host (often an IP).
	UpstreamServerName string
	// InsecureSkipVerify disables endpoint certificate verification
	// (SecurityE2ETLS). It exists for labs; it must be asked for.
	InsecureSkipVerify bool
	// Receipts says when responses carry the X-Loxilb-Route routing
	// receipt. The zero value, ReceiptsOff, never adds it: a receipt tells
	// whoever reads it how much of a prompt some endpoint already holds,
	// which lets any client probe other users' prompts.
	Receipts ReceiptPolicy
	// MaxStreamDuration caps how long an event-stream response is relayed
	// (the rule's max_stream_duration_sec): past it the stream is cut after
	// the event in hand. 0: no cap.
	MaxStreamDuration time.Duration
}

// ReceiptPolicy is when the proxy adds the routing receipt to a response.
// Whatever the policy, an X-Loxilb-Route header sent by an endpoint is
// never relayed, so only the proxy can speak for its own routing.
type ReceiptPolicy uint8

// Receipt policies.
const (
	// ReceiptsOff never adds the receipt (the default).
	ReceiptsOff ReceiptPolicy = iota
	// ReceiptsOnRequest adds it to responses to requests carrying
	// X-Loxilb-Receipt: 1.
	ReceiptsOnRequest
	// ReceiptsAlways adds it to every response.
	ReceiptsAlways
)

// ParseReceiptPolicy reads "off", "on-request" or "always".
func ParseReceiptPolicy(s string) (ReceiptPolicy, error) {
	switch s {
	case "off":
		return ReceiptsOff, nil
	case "on-request":
		return ReceiptsOnRequest, nil
	case "always":
		return ReceiptsAlways, nil
	}
	return ReceiptsOff, fmt.Errorf("receipt policy %q: want off, on-request or always", s)
}

// String is the name ParseReceiptPolicy reads.
func (p ReceiptPolicy) String() string {
	switch p {
	case ReceiptsOff:
		return "off"
	case ReceiptsOnRequest:
		return "on-request"
	case ReceiptsAlways:
		return "always"
	}
	return fmt.Sprintf("ReceiptPolicy(%d)", uint8(p))
}

// wants reports whether a request with these headers gets the receipt.
func (p ReceiptPolicy) wants(h http.Header) bool {
	return p == ReceiptsAlways || p == ReceiptsOnRequest && h.Get(HeaderReceiptRequest) == "1"
}

func (c Config) withDefaults() Config {
	def := func(d *time.Duration, v time.Duration) {
		if *d == 0 {
			*d = v
		}
	}
	if c.MaxBodyBytes == 0 {
		c.MaxBodyBytes = DefaultMaxBodyBytes
	}
	def(&c.ReadHeaderTimeout, DefaultReadHeaderTimeout)
	def(&c.BodyReadTimeout, DefaultBodyReadTimeout)
	def(&c.IdleTimeout, DefaultIdleTimeout)
	def(&c.DialTimeout, DefaultDialTimeout)
	def(&c.ResponseHeaderTimeout, DefaultResponseHeaderTimeout)
	def(&c.StreamIdleTimeout, DefaultStreamIdleTimeout)
	def(&c.UpstreamIdleTimeout, DefaultUpstreamIdleTimeout)
	def(&c.ShutdownGrace, DefaultShutdownGrace)
	if c.MaxIdleConnsPerHost == 0 {
		c.MaxIdleConnsPerHost = DefaultMaxIdleConnsPerHost
	}
	if c.MaxRetries == 0 {
		c.MaxRetries = DefaultMaxRetries
	}
	if c.UsageScanBytes == 0 {
		c.UsageScanBytes = DefaultUsageScanBytes
	}
	if c.MaxResponseHeaderBytes == 0 {
		c.MaxResponseHeaderBytes = DefaultMaxResponseHeaderBytes
	}
	if c.MaxInflightBodyBytes == 0 {
		c.MaxInflightBodyBytes = DefaultMaxInflightBodyBytes
	}
	if c.MaxConnsPerListener == 0 {
		c.MaxConnsPerListener = DefaultMaxConnsPerListener
	}
	return c
}

// validate reports every problem at once so an operator fixes a rule set
// in one round.
func (c Config) validate() error {
	var errs []error
	if c.MaxBodyBytes < 0 {
		errs = append(errs, fmt.Errorf("max body bytes %d is negative", c.MaxBodyBytes))
	}
	for name, d := range map[string]time.Duration{
		"read header timeout": c.ReadHeaderTimeout, "body read timeout": c.BodyReadTimeout,
		"idle timeout": c.IdleTimeout, "dial timeout": c.DialTimeout,
		"response header timeout": c.ResponseHeaderTimeout, "upstream idle timeout": c.UpstreamIdleTimeout,
		"shutdown grace": c.ShutdownGrace, "stream idle timeout": c.StreamIdleTimeout,
	} {
		if d < 0 {
			errs = append(errs, fmt.Errorf("%s %v is negative", name, d))
		}
	}
	if c.MaxIdleConnsPerHost < 0 {
		errs = append(errs, fmt.Errorf("max idle conns per host %d is negative", c.MaxIdleConnsPerHost))
	}
	if c.UsageScanBytes < 0 {
		errs = append(errs, fmt.Errorf("usage scan bytes %d is negative", c.UsageScanBytes))
	}
	if c.MaxResponseHeaderBytes < 0 {
		errs = append(errs, fmt.Errorf("max response header bytes %d is negative", c.MaxResponseHeaderBytes))
	}
	if c.MaxInflightBodyBytes < 0 {
		errs = append(errs, fmt.Errorf("max in-flight body bytes %d is negative", c.MaxInflightBodyBytes))
	} else if c.MaxInflightBodyBytes > 0 && c.MaxInflightBodyBytes < c.MaxBodyBytes {
		errs = append(errs, fmt.Errorf("max in-flight body bytes %d is below max body bytes %d: the largest allowed body could never be read",
			c.MaxInflightBodyBytes, c.MaxBodyBytes))
	}
	if c.MaxConnsPerListener < 0 {
		errs = append(errs, fmt.Errorf("max conns per listener %d is negative", c.MaxConnsPerListener))
	}
	ids := map[uint32]bool{}
	addrs := map[netip.AddrPort]uint32{}
	for _, s := range c.Services {
		if ids[s.ID] {
			errs = append(errs, fmt.Errorf("service %d: duplicate service id", s.ID))
		}
		ids[s.ID] = true
		if !s.Listen.IsValid() || s.Listen.Port() == 0 {
			errs = append(errs, fmt.Errorf("service %d: listen address %q needs an IP and a non-zero port", s.ID, s.Listen))
		} else if other, dup := addrs[normAddrPort(s.Listen)]; dup {
			errs = append(errs, fmt.Errorf("service %d: listen address %s already used by service %d", s.ID, s.Listen, other))
		} else {
			addrs[normAddrPort(s.Listen)] = s.ID
		}
		switch s.Security {
		case SecurityPlain:
		case SecurityTLS, SecurityE2ETLS:
			if s.CertFile == "" || s.KeyFile == "" {
				errs = append(errs, fmt.Errorf("service %d: security %d needs a certificate and key file", s.ID, s.Security))
			}
		default:
			errs = append(errs, fmt.Errorf("service %d: security %d unknown (want 0 plaintext, 1 TLS termination, 2 TLS both legs)", s.ID, s.Security))
		}
		if s.Receipts > ReceiptsAlways {
			errs = append(errs, fmt.Errorf("service %d: receipt policy %d unknown", s.ID, s.Receipts))
		}
		if (s.ClientCertFile == "") != (s.ClientKeyFile == "") {
			errs = append(errs, fmt.Errorf("service %d: client certificate and key must be given together", s.ID))
		}
		switch {
		case s.ClientAuth > ClientAuthRequired:
			errs = append(errs, fmt.Errorf("service %d: client auth mode %d unknown", s.ID, s.ClientAuth))
		case s.ClientAuth != ClientAuthOff && s.Security == SecurityPlain:
			errs = append(errs, fmt.Errorf("service %d: client certificates need TLS at the VIP (security 1 or 2)", s.ID))
		case s.ClientAuth != ClientAuthOff && s.ClientCAFile == "" && len(s.ClientCAPEM) == 0:
			errs = append(errs, fmt.Errorf("service %d: client certificate verification needs a client CA", s.ID))
		}
		if _, err := path.Match(s.ClientCNPattern, ""); err != nil {
			errs = append(errs, fmt.Errorf("service %d: client CN pattern %q: %w", s.ID, s.ClientCNPattern, err))
		}
	}
	return errors.Join(errs...)
}

func normAddrPort(ap netip.AddrPort) netip.AddrPort {
	return netip.AddrPortFrom(ap.Addr().Unmap(), ap.Port())
}

// serverTLS loads the certificate clients see. Only HTTP/1.1 is offered:
// the proxy relays SSE with per-write flushes, which HTTP/1.1 chunking
// serves well, and one protocol keeps the relay path single.
//
// With ClientAuth set, clients are asked for a certificate, which
// verifyClient checks; reject counts each refusal by reason.
func (s Service) serverTLS(reject func(reason string)) (*tls.Config, error) {
	cert, err := tls.LoadX509KeyPair(s.CertFile, s.KeyFile)
	if err != nil {
		return nil, fmt.Errorf("service %d: load certificate %s / key %s: %w", s.ID, s.CertFile, s.KeyFile, err)
	}
	tc := &tls.Config{
		Certificates: []tls.Certificate{cert},
		NextProtos:   []string{"http/1.1"},
		MinVersion:   tls.VersionTLS12,
	}
	if s.ClientAuth != ClientAuthOff {
		pool, err := s.clientPool()
		if err != nil {
			return nil, err
		}
		// RequestClientCert leaves verification (and the refusal of a
		// missing certificate) to verifyClient, which counts them.
		tc.ClientAuth = tls.RequestClientCert
		tc.ClientCAs = pool // names the acceptable CAs to the client
		tc.VerifyPeerCertificate = verifyClient(s.ClientAuth, pool, s.ClientCNPattern, reject)
	}
	return tc, nil
}

// LoadTLS reads and parses every certificate, key and CA file the
// service's listener and endpoint connections use, so a caller can refuse
// one rule with a bad file before handing the whole table to Update.
func (s Service) LoadTLS() error {
	if s.Security != SecurityPlain {
		if _, err := s.serverTLS(func(string) {}); err != nil {
			return err
		}
	}
	if s.Security == SecurityE2ETLS {
		if _, err := s.upstreamTLS(); err != nil {
			return err
		}
	}
	return nil
}

// upstreamTLS builds the client-side TLS config for SecurityE2ETLS.
func (s Service) upstreamTLS() (*tls.Config, error) {
	tc := &tls.Config{
		ServerName:         s.UpstreamServerName,
		InsecureSkipVerify: s.InsecureSkipVerify,
		NextProtos:         []string{"http/1.1"},
		MinVersion:         tls.VersionTLS12,
	}
	if s.CAFile != "" {
		pem, err := os.ReadFile(s.CAFile)
		if err != nil {
			return nil, fmt.Errorf("service %d: read CA file: %w", s.ID, err)
		}
		pool := x509.NewCertPool()
		if !pool.AppendCertsFromPEM(pem) {
			return nil, fmt.Errorf("service %d: CA file %s holds no PEM certificate", s.ID, s.CAFile)
		}
		tc.RootCAs = pool
	}
	if s.ClientCertFile != "" {
		cert, err := tls.LoadX509KeyPair(s.ClientCertFile, s.ClientKeyFile)
		if err != nil {
			return nil, fmt.Errorf("service %d: load client certificate %s / key %s: %w", s.ID, s.ClientCertFile, s.ClientKeyFile, err)
		}
		tc.Certificates = []tls.Certificate{cert}
	}
	return tc, nil
}
