// Package lbrule holds the domain types of a load-balancer rule (the
// loxilb-compatible serviceArguments and endpoints, including the KV-exact and
// prefill/decode fields), their defaults, and the one place where a rule is
// validated.
//
// In: the JSON body of POST /netlox/v1/config/loadbalancer (Decode) or a Rule
// built by loxicmd. Out: a normalized Rule with defaults applied, or a
// *RuleError that names the field, the fix and the HTTP status class.
//
// Neighbours: api decodes and maps errors to statuses; control stores and
// reconciles accepted rules; engine supplies the per-engine capability matrix.
// No I/O happens here; the environment is read through a lookup function so
// tests and the capability API share one predicate with validation.
package lbrule
