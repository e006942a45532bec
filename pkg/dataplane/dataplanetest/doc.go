// Package dataplanetest holds what tests of data plane implementations
// share: the conformance suite every dataplane.Dataplane must pass, and
// helpers for privileged tests (root check, throwaway network namespaces,
// re-running a test inside one).
//
// Privileged tests run when the process is root. Elsewhere they skip with a
// message, except under CI=true, where a missing privilege is a failure.
package dataplanetest
