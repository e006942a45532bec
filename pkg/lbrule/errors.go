package lbrule

import (
	"errors"
	"fmt"
)

// Sentinel classes of rule errors. Callers branch with errors.Is and map each
// class to one HTTP status; the message itself is never inspected.
var (
	// ErrInvalid: the rule body is malformed or violates a constraint (400).
	ErrInvalid = errors.New("invalid rule")
	// ErrConflict: the rule exists already, or an immutable field changed (409).
	ErrConflict = errors.New("rule conflict")
	// ErrPrecondition: the gateway's launch environment cannot serve the rule (412).
	ErrPrecondition = errors.New("server precondition not met")
	// ErrNotFound: no such rule (404).
	ErrNotFound = errors.New("rule not found")
)

// Reason codes of precondition failures; stable, documented, shown by the
// capability API too.
const (
	ReasonSeedUnset   = "KV_EXACT_SEED_UNSET"
	ReasonSeedTooLong = "KV_EXACT_SEED_TOO_LONG"
	ReasonSeedInvalid = "KV_EXACT_SEED_INVALID"
	// ReasonProxyTLSUnset: a rule asks for TLS (security 1 or 2) but the
	// daemon was started without --proxy-tls-cert and --proxy-tls-key.
	ReasonProxyTLSUnset = "PROXY_TLS_CERT_UNSET"
	// ReasonTLSFileInvalid: a certificate, key or CA file a TLS rule
	// uses (the daemon's or the rule's own) cannot be read or parsed.
	ReasonTLSFileInvalid = "TLS_FILE_INVALID"
)

// RuleError is a rejected rule: which field, what is wrong and how to fix it.
type RuleError struct {
	Class  error  // one of the sentinels above
	Field  string // JSON path of the offending field, e.g. "serviceArguments.kvDpRankCount"
	Msg    string // what is wrong, and the fix
	Reason string // stable reason code for preconditions; empty otherwise
}

func (e *RuleError) Error() string {
	if e.Field == "" {
		return e.Msg
	}
	return e.Field + ": " + e.Msg
}

// Unwrap lets errors.Is match the class sentinel.
func (e *RuleError) Unwrap() error { return e.Class }

func invalid(field, format string, args ...any) *RuleError {
	return &RuleError{Class: ErrInvalid, Field: field, Msg: fmt.Sprintf(format, args...)}
}

func svcField(name string) string { return "serviceArguments." + name }

func epField(i int, name string) string { return fmt.Sprintf("endpoints[%d].%s", i, name) }
