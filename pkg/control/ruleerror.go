package control

// RuleError is a stage's report that one rule could not be put into effect.
// A reconciler that returns RuleErrors (joined with errors.Join) has still
// applied every other rule of the same call: one bad rule never holds the
// others back.
type RuleError struct {
	ID     uint32 // the rule's service id
	Reason string // stable reason code for the API and metrics, e.g. "LISTEN_FAILED"
	Err    error  // what went wrong, naming the resource
	// Degraded says the rule still serves without this stage's part (KV
	// subscriptions, health probes); otherwise it does not serve.
	Degraded bool
}

func (e *RuleError) Error() string { return e.Err.Error() }
func (e *RuleError) Unwrap() error { return e.Err }

// RuleErrors returns every RuleError inside err, looking through
// errors.Join trees and %w wrapping.
func RuleErrors(err error) []*RuleError {
	var out []*RuleError
	var walk func(error)
	walk = func(err error) {
		if err == nil {
			return
		}
		if re, ok := err.(*RuleError); ok {
			out = append(out, re)
			return
		}
		switch u := err.(type) {
		case interface{ Unwrap() []error }:
			for _, e := range u.Unwrap() {
				walk(e)
			}
		case interface{ Unwrap() error }:
			walk(u.Unwrap())
		}
	}
	walk(err)
	return out
}

var _ error = (*RuleError)(nil)
