package proxy

import (
	"crypto/x509"
	"errors"
	"fmt"
	"os"
	"path"
)

// ClientAuth is how a TLS-terminating rule treats client certificates at
// the VIP (loxilb's mtls_frontend client_cert_mode).
type ClientAuth uint8

const (
	// ClientAuthOff asks clients for no certificate.
	ClientAuthOff ClientAuth = iota
	// ClientAuthOptional asks for a certificate and verifies it when one
	// is sent; a client without one is served.
	ClientAuthOptional
	// ClientAuthRequired refuses the handshake of a client that sends no
	// certificate or one that does not verify.
	ClientAuthRequired
)

// clientPool builds the pool client certificates are verified against from
// the service's CA file and inline PEM (both may be set; both count).
func (s Service) clientPool() (*x509.CertPool, error) {
	pool := x509.NewCertPool()
	n := 0
	if s.ClientCAFile != "" {
		pem, err := os.ReadFile(s.ClientCAFile)
		if err != nil {
			return nil, fmt.Errorf("service %d: read client CA file: %w", s.ID, err)
		}
		if !pool.AppendCertsFromPEM(pem) {
			return nil, fmt.Errorf("service %d: client CA file %s holds no PEM certificate", s.ID, s.ClientCAFile)
		}
		n++
	}
	if len(s.ClientCAPEM) > 0 {
		if !pool.AppendCertsFromPEM(s.ClientCAPEM) {
			return nil, fmt.Errorf("service %d: inline client CA holds no PEM certificate", s.ID)
		}
		n++
	}
	if n == 0 {
		return nil, fmt.Errorf("service %d: client certificate verification needs a client CA", s.ID)
	}
	return pool, nil
}

// verifyClient checks the certificate chain a client sent, the way
// crypto/tls does for RequireAndVerifyClientCert (chain to the pool, the
// leaf valid for client authentication), and then the CN pattern. It is
// done here rather than by crypto/tls so that every refusal is counted
// by reason: crypto/tls reports a failed handshake only to the error log.
func verifyClient(mode ClientAuth, pool *x509.CertPool, cnPattern string, reject func(reason string)) func([][]byte, [][]*x509.Certificate) error {
	return func(raw [][]byte, _ [][]*x509.Certificate) error {
		if len(raw) == 0 {
			if mode == ClientAuthRequired || cnPattern != "" {
				reject("client_cert_missing")
				return errors.New("client certificate required")
			}
			return nil
		}
		certs := make([]*x509.Certificate, 0, len(raw))
		for _, der := range raw {
			c, err := x509.ParseCertificate(der)
			if err != nil {
				reject("client_cert_invalid")
				return fmt.Errorf("client certificate: %w", err)
			}
			certs = append(certs, c)
		}
		opts := x509.VerifyOptions{Roots: pool, Intermediates: x509.NewCertPool(), KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth}}
		for _, c := range certs[1:] {
			opts.Intermediates.AddCert(c)
		}
		if _, err := certs[0].Verify(opts); err != nil {
			reject("client_cert_invalid")
			return fmt.Errorf("client certificate: %w", err)
		}
		if cnPattern != "" {
			if ok, _ := path.Match(cnPattern, certs[0].Subject.CommonName); !ok {
				reject("client_cn_mismatch")
				return fmt.Errorf("client certificate CN %q does not match %q", certs[0].Subject.CommonName, cnPattern)
			}
		}
		return nil
	}
}
