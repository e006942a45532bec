package store

import (
	"context"
	"errors"
	"fmt"
	"time"
)

// ErrUnavailable marks a write (or read) that the store could not carry
// out because its backend cannot be reached; the API answers 503 and the
// node keeps serving the rules it already has.
var ErrUnavailable = errors.New("rule store unavailable")

// ErrTooLarge marks a record larger than the backend takes in one request
// (etcd's --max-request-bytes, 1.5 MiB by default); the API answers 413.
var ErrTooLarge = errors.New("rule record too large for the store")

// ErrClaimed marks a write refused because another record holds one of
// its claims (another node created the same rule first); the API answers
// 409.
var ErrClaimed = errors.New("claim held by another rule")

// ClaimError names the claim and the record that holds it. It matches
// ErrClaimed with errors.Is.
type ClaimError struct {
	Claim  string
	Holder uint32
}

func (e *ClaimError) Error() string {
	return fmt.Sprintf("%s is held by rule %d", e.Claim, e.Holder)
}

// Is makes errors.Is(err, ErrClaimed) hold.
func (e *ClaimError) Is(target error) bool { return target == ErrClaimed }

// UnavailableError says which backend could not be reached, since when and
// why. It matches ErrUnavailable with errors.Is.
type UnavailableError struct {
	Backend string // e.g. "etcd 127.0.0.1:2379"
	Since   time.Time
	Err     error
}

func (e *UnavailableError) Error() string {
	s := "rule store " + e.Backend + " is unreachable"
	if !e.Since.IsZero() {
		s += " since " + e.Since.UTC().Format(time.RFC3339)
	}
	if e.Err != nil {
		s += ": " + e.Err.Error()
	}
	return s + "; rules are not changed until it is back (the rules already applied keep serving)"
}

// Is makes errors.Is(err, ErrUnavailable) hold.
func (e *UnavailableError) Is(target error) bool { return target == ErrUnavailable }

func (e *UnavailableError) Unwrap() error { return e.Err }

// Health is a backend's reachability, for the capabilities and the
// loxilb_store_backend_up metric.
type Health struct {
	Backend string // "bbolt" or "etcd"
	Where   string // the file or the endpoints
	Up      bool
	Since   time.Time // when Up last changed (zero for a backend that is always up)
	Err     string    // the last failure while down
}

// Watcher is a store that other writers change too (several nodes on one
// store). Watch calls changed, without arguments, after every change it
// sees and whenever it may have missed some (a reconnect), until ctx ends;
// the caller then re-reads List. It returns only when ctx ends.
type Watcher interface {
	Watch(ctx context.Context, changed func()) error
}
