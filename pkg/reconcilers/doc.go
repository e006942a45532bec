// Package reconcilers keeps the stages that know nothing of rules in step
// with the rule set: the proxy's listeners (Listeners, stage "proxy"), the
// KV-event subscriptions and inventories (KVEvents, stage "kv-events") and
// the health prober (Health, stage "health"). Each is a control.Reconciler:
// control calls it with the complete desired set after every change, and
// it renders the rules into that stage's own configuration, reporting a
// rule it cannot apply as that rule's control.RuleError so the others are
// served.
//
// They live apart from pkg/gateway, which is the mode-4 picker only and
// whose own Reconcile rebuilds its routing table, so the proxy is
// configured by control and never through the gateway, and no stage
// imports another to be configured.
package reconcilers
