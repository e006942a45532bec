// Package control turns the desired rule set into running state.
//
// In: rule bodies from the API (create, delete by key or name), the records
// of the rule store at start-up and, with a store other nodes share (etcd),
// the store's records again after every change it reports (Follow, Resync). Out: a validated, persisted rule table, and a
// full desired-state snapshot handed to every Reconciler (the eBPF data plane,
// the mode-4 proxy tables, the KV-event subscriptions, the health prober)
// after each change. Control is the only writer of those stages, so they never
// disagree about which rules exist. Stages apply rules one by one and
// report the ones they cannot apply (RuleError); the controller keeps every
// rule's status (applied, degraded, failed with a reason code), lists
// stored rules that no longer validate instead of dropping them, and
// retries failed rules with backoff (Run).
//
// Neighbours: lbrule (validation), store (persistence), api (callers).
package control
