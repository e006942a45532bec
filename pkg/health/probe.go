package health

import (
	"errors"
	"fmt"
	"strings"
	"time"
)

// ProbeType is the rule's `probetype`.
type ProbeType string

// Probe types.
const (
	ProbeNone  ProbeType = "none"
	ProbeTCP   ProbeType = "tcp"
	ProbeHTTP  ProbeType = "http"
	ProbeHTTPS ProbeType = "https"
	ProbePing  ProbeType = "ping"
)

// Errors callers branch on (rule validation answers 400 for them).
var (
	// ErrUnsupportedProbe is returned for probe types loxilb knows but this
	// product does not implement (udp, sctp).
	ErrUnsupportedProbe = errors.New("unsupported probe type")
	// ErrInvalidProbe is returned for malformed probe settings.
	ErrInvalidProbe = errors.New("invalid probe settings")
)

// ParseProbeType maps the rule's `probetype` string. An empty string means
// tcp, loxilb's default L4 connect probe.
func ParseProbeType(s string) (ProbeType, error) {
	switch t := ProbeType(strings.ToLower(strings.TrimSpace(s))); t {
	case "":
		return ProbeTCP, nil
	case ProbeNone, ProbeTCP, ProbeHTTP, ProbeHTTPS, ProbePing:
		return t, nil
	case "udp", "sctp":
		return "", fmt.Errorf("probetype %q: %w: inference endpoints speak HTTP over TCP; use tcp, http, https, ping or none", s, ErrUnsupportedProbe)
	case "icmp":
		return ProbePing, nil
	}
	return "", fmt.Errorf("probetype %q: %w: want tcp, http, https, ping or none", s, ErrInvalidProbe)
}

// MonitorEnabled applies loxilb's rule: setting a probe type other than
// none turns monitoring on even if `monitor` is false.
func MonitorEnabled(monitor bool, probetype string) bool {
	t := strings.ToLower(strings.TrimSpace(probetype))
	return monitor || (t != "" && t != string(ProbeNone))
}

// Probe is how one endpoint is checked.
type Probe struct {
	Type ProbeType
	// Port is the rule's `probeport`; 0 probes the endpoint's target port.
	Port uint16
	// Request is `probereq`: the HTTP path (default "/"), or bytes to send
	// on a tcp probe (none by default).
	Request string
	// Response is `proberesp`: a substring the HTTP body or tcp reply must
	// contain. Empty accepts any.
	Response string
	// Interval is the probe period (the rule's `probeTimeout`, seconds in
	// loxilb). 0 means Config.Interval.
	Interval time.Duration
	// Retries is `probeRetries`: consecutive failures before down. 0 means
	// Config.Retries.
	Retries int
}

// ProbeFromRule builds a Probe from the rule fields, validating them:
// probetype, probeport, probereq, proberesp, probeTimeout (seconds) and
// probeRetries. Zero values select the defaults.
func ProbeFromRule(probetype string, probeport int, probereq, proberesp string, probeTimeoutSec, probeRetries int) (Probe, error) {
	t, err := ParseProbeType(probetype)
	if err != nil {
		return Probe{}, err
	}
	p := Probe{Type: t, Request: probereq, Response: proberesp, Retries: probeRetries}
	if probeport < 0 || probeport > 65535 {
		return Probe{}, fmt.Errorf("%w: probeport %d outside 0..65535", ErrInvalidProbe, probeport)
	}
	p.Port = uint16(probeport)
	if probeTimeoutSec < 0 || probeTimeoutSec > 86400 {
		return Probe{}, fmt.Errorf("%w: probeTimeout %d s outside 0..86400", ErrInvalidProbe, probeTimeoutSec)
	}
	p.Interval = time.Duration(probeTimeoutSec) * time.Second
	if probeRetries < 0 || probeRetries > 100 {
		return Probe{}, fmt.Errorf("%w: probeRetries %d outside 0..100", ErrInvalidProbe, probeRetries)
	}
	return p, p.validate()
}

func (p Probe) validate() error {
	switch p.Type {
	case ProbeNone, ProbeTCP, ProbeHTTP, ProbeHTTPS, ProbePing:
	case "udp", "sctp":
		return fmt.Errorf("probetype %q: %w", p.Type, ErrUnsupportedProbe)
	default:
		return fmt.Errorf("%w: probetype %q", ErrInvalidProbe, p.Type)
	}
	if p.Interval < 0 || p.Retries < 0 {
		return fmt.Errorf("%w: negative interval %v or retries %d", ErrInvalidProbe, p.Interval, p.Retries)
	}
	if (p.Type == ProbeHTTP || p.Type == ProbeHTTPS) && strings.ContainsAny(p.Request, " \r\n") {
		return fmt.Errorf("%w: probereq %q is not a URL path", ErrInvalidProbe, p.Request)
	}
	return nil
}
