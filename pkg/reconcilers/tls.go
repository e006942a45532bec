package reconcilers

import (
	"encoding/base64"
	"fmt"

	"github.com/loxilb-llm/loxilb/pkg/lbrule"
	"github.com/loxilb-llm/loxilb/pkg/proxy"
)

// ruleTLS fills in a mode-4 rule's TLS settings: the daemon's files first,
// then the rule's mtls_backend and mtls_frontend in their place. It then
// loads every file the rule's listener and endpoint connections will use,
// so a missing or bad file refuses this rule (412, naming the file) and
// not the whole proxy table. Called with the rule's security already set.
func (c *ListenerConfig) ruleTLS(ps *proxy.Service, r *lbrule.Rule) error {
	ps.CertFile, ps.KeyFile, ps.CAFile = c.CertFile, c.KeyFile, c.CAFile
	if ps.Security == proxy.SecurityE2ETLS {
		ps.ClientCertFile, ps.ClientKeyFile = c.ClientCertFile, c.ClientKeyFile
	}
	if b := r.Service.MTLSBackend; b != nil {
		// mtls_backend: the rule's own endpoint CA and client
		// certificate (security 2) take the daemon's place.
		if b.BackendCAPath != "" {
			ps.CAFile = b.BackendCAPath
		}
		if b.ClientCertPath != "" {
			ps.ClientCertFile, ps.ClientKeyFile = b.ClientCertPath, b.ClientKeyPath
		}
	}
	if ps.Security != proxy.SecurityPlain && (ps.CertFile == "" || ps.KeyFile == "") {
		return &lbrule.RuleError{Class: lbrule.ErrPrecondition, Field: "serviceArguments.security", Reason: lbrule.ReasonProxyTLSUnset,
			Msg: fmt.Sprintf("security %d needs the daemon started with --proxy-tls-cert and --proxy-tls-key", r.Service.Security)}
	}
	if f := r.Service.MTLSFrontend; f != nil && (f.ClientCertMode == "optional" || f.ClientCertMode == "required") {
		ps.ClientAuth = proxy.ClientAuthOptional
		if f.ClientCertMode == "required" {
			ps.ClientAuth = proxy.ClientAuthRequired
		}
		if f.RequireClientCN {
			ps.ClientCNPattern = f.ClientCNPattern
		}
		// The rule's CA (path, inline PEM or both) replaces the daemon's.
		ps.ClientCAFile = f.ClientCAPath
		if f.ClientCACertData != "" {
			pem, err := base64.StdEncoding.DecodeString(f.ClientCACertData) // checked by lbrule
			if err != nil {
				return &lbrule.RuleError{Class: lbrule.ErrInvalid, Field: "serviceArguments.mtls_frontend.client_ca_cert_data", Msg: err.Error()}
			}
			ps.ClientCAPEM = pem
		}
		if ps.ClientCAFile == "" && len(ps.ClientCAPEM) == 0 {
			ps.ClientCAFile = c.ClientCAFile
		}
		if ps.ClientCAFile == "" && len(ps.ClientCAPEM) == 0 {
			return &lbrule.RuleError{Class: lbrule.ErrPrecondition, Field: "serviceArguments.mtls_frontend.client_cert_mode", Reason: lbrule.ReasonMTLSFrontendUnsupported,
				Msg: fmt.Sprintf("client_cert_mode %s needs a CA to verify client certificates against: set mtls_frontend.client_ca_path or client_ca_cert_data, or start the daemon with --proxy-tls-client-ca", f.ClientCertMode)}
		}
	}
	if err := ps.LoadTLS(); err != nil {
		return &lbrule.RuleError{Class: lbrule.ErrPrecondition, Field: "serviceArguments.security", Reason: lbrule.ReasonTLSFileInvalid, Msg: err.Error()}
	}
	return nil
}
