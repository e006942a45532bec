// Package control turns the desired rule set into running state.
//
// In: rule bodies from the API (create, delete by key or name) and the records
// of the rule store at start-up. Out: a validated, persisted rule table, and a
// full desired-state snapshot handed to every Reconciler (the eBPF data plane,
// the mode-4 proxy tables, the KV-event subscriptions, the health prober)
// after each change. Control is the only writer of those stages, so they never
// disagree about which rules exist.
//
// Neighbours: lbrule (validation), store (persistence), api (callers).
package control
