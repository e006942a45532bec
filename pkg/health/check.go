package health

import (
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"strings"
	"syscall"
)

// maxProbeBody bounds how much of a reply is searched for `proberesp`.
const maxProbeBody = 64 << 10

// probeError carries a failure reason for the metrics.
type probeError struct {
	reason string
	err    error
}

func (e *probeError) Error() string { return e.reason + ": " + e.err.Error() }
func (e *probeError) Unwrap() error { return e.err }

func (p *Prober) check(ctx context.Context, t Target, addr netip.AddrPort) error {
	switch t.Probe.Type {
	case ProbeTCP:
		return checkTCP(ctx, addr, t.Probe.Request, t.Probe.Response)
	case ProbeHTTP:
		return checkHTTP(ctx, p.http, "http", addr, t.Probe.Request, t.Probe.Response)
	case ProbeHTTPS:
		return checkHTTP(ctx, p.https, "https", addr, t.Probe.Request, t.Probe.Response)
	case ProbePing:
		return p.ping.echo(ctx, addr.Addr())
	}
	return nil
}

func checkTCP(ctx context.Context, addr netip.AddrPort, req, resp string) error {
	var d net.Dialer
	conn, err := d.DialContext(ctx, "tcp", addr.String())
	if err != nil {
		return err
	}
	defer conn.Close()
	if req == "" && resp == "" {
		return nil
	}
	if dl, ok := ctx.Deadline(); ok {
		_ = conn.SetDeadline(dl)
	}
	if req != "" {
		if _, err := io.WriteString(conn, req); err != nil {
			return err
		}
	}
	if resp == "" {
		return nil
	}
	buf := make([]byte, 0, 4096)
	tmp := make([]byte, 4096)
	for len(buf) < maxProbeBody {
		n, err := conn.Read(tmp)
		buf = append(buf, tmp[:n]...)
		if bytes.Contains(buf, []byte(resp)) {
			return nil
		}
		if err != nil {
			if errors.Is(err, io.EOF) {
				break
			}
			return err
		}
	}
	return &probeError{reason: "body", err: fmt.Errorf("reply %q lacks %q", truncate(buf), resp)}
}

func checkHTTP(ctx context.Context, c *http.Client, scheme string, addr netip.AddrPort, path, resp string) error {
	if path == "" {
		path = "/"
	} else if !strings.HasPrefix(path, "/") {
		path = "/" + path
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, scheme+"://"+addr.String()+path, nil)
	if err != nil {
		return &probeError{reason: "error", err: err}
	}
	req.Header.Set("User-Agent", "loxilb-health/1")
	r, err := c.Do(req)
	if err != nil {
		return err
	}
	defer r.Body.Close()
	if r.StatusCode < 200 || r.StatusCode > 299 {
		_, _ = io.Copy(io.Discard, io.LimitReader(r.Body, maxProbeBody))
		return &probeError{reason: "status", err: fmt.Errorf("GET %s: status %d", path, r.StatusCode)}
	}
	if resp == "" {
		_, _ = io.Copy(io.Discard, io.LimitReader(r.Body, maxProbeBody))
		return nil
	}
	body, err := io.ReadAll(io.LimitReader(r.Body, maxProbeBody))
	if err != nil && !bytes.Contains(body, []byte(resp)) {
		return err
	}
	if !bytes.Contains(body, []byte(resp)) {
		return &probeError{reason: "body", err: fmt.Errorf("GET %s: body %q lacks %q", path, truncate(body), resp)}
	}
	return nil
}

func truncate(b []byte) string {
	if len(b) > 64 {
		return string(b[:64]) + "..."
	}
	return string(b)
}

// classify maps a probe error to a metric reason.
func classify(err error) string {
	var pe *probeError
	if errors.As(err, &pe) {
		return pe.reason
	}
	var ne net.Error
	switch {
	case errors.Is(err, context.DeadlineExceeded), errors.As(err, &ne) && ne.Timeout():
		return "timeout"
	case errors.Is(err, syscall.ECONNREFUSED):
		return "refused"
	case errors.Is(err, syscall.ECONNRESET), errors.Is(err, syscall.EPIPE), errors.Is(err, io.ErrUnexpectedEOF), errors.Is(err, io.EOF):
		return "reset"
	case errors.Is(err, syscall.EHOSTUNREACH), errors.Is(err, syscall.ENETUNREACH), errors.Is(err, syscall.EADDRNOTAVAIL):
		return "unreachable"
	}
	var (
		rh  tls.RecordHeaderError
		ua  x509.UnknownAuthorityError
		hn  x509.HostnameError
		ci  x509.CertificateInvalidError
		ve  *tls.CertificateVerificationError
		alt tls.AlertError
	)
	if errors.As(err, &rh) || errors.As(err, &ua) || errors.As(err, &hn) || errors.As(err, &ci) || errors.As(err, &ve) || errors.As(err, &alt) {
		return "tls"
	}
	return "error"
}
