package reconcilers

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"sync"
	"time"

	"github.com/loxilb-llm/loxilb/pkg/control"
	"github.com/loxilb-llm/loxilb/pkg/lbrule"
	"github.com/loxilb-llm/loxilb/pkg/proxy"
)

// ProxyTable is the proxy's rule table (*proxy.Server).
type ProxyTable interface {
	Update(cfg proxy.Config) error
}

// ListenerConfig is what the proxy's per-rule listeners are built from
// besides the rules: the daemon's proxy knobs and TLS files.
type ListenerConfig struct {
	// Proxy carries the process-wide proxy knobs (timeouts, body limit);
	// Services is filled in by Reconcile.
	Proxy proxy.Config
	// TLS files served by rules with security 1 or 2, and the CA that
	// endpoint certificates are verified against for security 2.
	CertFile, KeyFile, CAFile string
	// ClientCertFile and ClientKeyFile are presented to endpoints of rules
	// with security 2 (--proxy-tls-client-cert/-key); a rule's
	// mtls_backend client certificate replaces them.
	ClientCertFile, ClientKeyFile string
	// ClientCAFile verifies client certificates at VIPs of rules whose
	// mtls_frontend asks for them and names no CA (--proxy-tls-client-ca).
	ClientCAFile string
	// Receipts is when responses carry the routing receipt header
	// (--proxy-receipts); off by default, because a receipt reveals what
	// other clients' prompts left cached.
	Receipts proxy.ReceiptPolicy
}

// Listeners hands the proxy the listener set of the mode-4 rules:
// VIP:port, security level and TLS files, stream bound. It is its own
// stage, apart from the gateway's routing table, so the proxy (which
// takes the gateway as its Picker) is configured by the controller and
// never through the gateway. Rules are applied one by one: a rule that
// cannot be (its VIP:port is held, it needs TLS files the daemon lacks or
// a file is bad) is reported as a control.RuleError and the others get
// their listeners. The daemon registers it just before the gateway: a
// rule's listener failure is reported under this stage's name, "proxy",
// and a removed rule's listener closes before the gateway forgets its
// routing state, so no connection reaches a rule the gateway no longer
// knows.
type Listeners struct {
	// Proxy is the proxy whose table the listeners go to; required.
	Proxy  ProxyTable
	Config ListenerConfig

	mu sync.Mutex // serializes Reconcile
}

var _ control.Reconciler = (*Listeners)(nil)

// Name implements control.Reconciler.
func (l *Listeners) Name() string { return "proxy" }

// Reconcile implements control.Reconciler.
func (l *Listeners) Reconcile(_ context.Context, services []control.Service) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	pcfg := l.Config.Proxy
	pcfg.Services = nil
	var errs []error
	for _, cs := range services {
		if cs.Rule.Service.Mode != lbrule.ModeFullProxy {
			continue
		}
		ps, err := l.service(cs)
		if err != nil {
			errs = append(errs, err)
			continue
		}
		pcfg.Services = append(pcfg.Services, ps)
	}
	err := l.Proxy.Update(pcfg)
	if err != nil && len(listenErrors(err)) == 0 {
		return errors.Join(append(errs, err)...)
	}
	// The proxy applied the table; these rules have no listener yet
	// and get one at a later reconcile (the controller retries).
	for _, le := range listenErrors(err) {
		errs = append(errs, &control.RuleError{ID: le.ID, Reason: le.Reason(), Err: le})
	}
	return errors.Join(errs...)
}

// service renders one mode-4 rule as the proxy's service; the error is
// the rule's control.RuleError.
func (l *Listeners) service(cs control.Service) (proxy.Service, error) {
	r := cs.Rule
	vip, err := netip.ParseAddr(r.Service.ExternalIP)
	if err != nil {
		return proxy.Service{}, &control.RuleError{ID: cs.ID, Reason: control.ReasonStageFailed, Err: fmt.Errorf("rule %d: %w", cs.ID, err)}
	}
	ps := proxy.Service{ID: cs.ID, Listen: netip.AddrPortFrom(vip, uint16(r.Service.Port)), Security: proxy.Security(r.Service.Security),
		Receipts: l.Config.Receipts}
	// max_stream_duration_sec: 0 is loxilb's 24 h hard cap.
	ps.MaxStreamDuration = time.Duration(r.Service.MaxStreamDurationSec) * time.Second
	if ps.MaxStreamDuration == 0 {
		ps.MaxStreamDuration = lbrule.MaxStreamDurationSec * time.Second
	}
	if err := l.Config.ruleTLS(&ps, r); err != nil {
		reason := control.ReasonStageFailed
		var re *lbrule.RuleError
		if errors.As(err, &re) && re.Reason != "" {
			reason = re.Reason
		}
		return proxy.Service{}, &control.RuleError{ID: cs.ID, Reason: reason, Err: fmt.Errorf("rule %d: %w", cs.ID, err)}
	}
	return ps, nil
}

// listenErrors returns the proxy's per-rule listen failures inside err.
func listenErrors(err error) []*proxy.ListenError {
	switch e := err.(type) {
	case *proxy.ListenError:
		return []*proxy.ListenError{e}
	case interface{ Unwrap() []error }:
		var out []*proxy.ListenError
		for _, x := range e.Unwrap() {
			out = append(out, listenErrors(x)...)
		}
		return out
	case interface{ Unwrap() error }:
		return listenErrors(e.Unwrap())
	}
	return nil
}
