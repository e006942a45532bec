package dispatch

import (
	"context"
	"errors"
	"fmt"
	"net"

	"github.com/loxilb-llm/loxilb/pkg/proxy"
)

// The dispatcher's failures wrap pkg/proxy's sentinels (ErrQueueFull,
// ErrTotalCap, ErrParkTimeout, ErrUnavailable, ErrParamsMissing,
// ErrParamsMalformed, ErrUpstreamConnect, ErrUpstreamTLS,
// ErrUpstreamTimeout, ErrUpstreamProtocol, ErrUpstreamStatus,
// ErrBadRequest, ErrClientCanceled); a failed leg is a *proxy.LegError.
// The proxy's single mapping function (proxy.VerdictFor, proxy.WriteError)
// answers them, so a P/D rule's client sees the same statuses, codes and
// Retry-After as any other mode-4 rule's.

// errNoLegs means a request came without the upstream for its legs
// (Request.Legs): a wiring bug, answered 500.
var errNoLegs = errors.New("P/D request without an upstream for its legs (Request.Legs)")

// errTooLong marks a prefill response over Config.MaxPrefillBody.
var errTooLong = errors.New("response too long")

// legFailure wraps a leg's failure with the proxy's sentinel for it (an
// error from the proxy's RoundTripper already carries one; a broken body
// read does not) and returns its class and whether the endpoint was never
// reached, so another endpoint may be tried.
func legFailure(err error) (wrapped error, class proxy.ErrorClass, connectFailed bool) {
	if errors.Is(err, errTooLong) {
		return fmt.Errorf("%w: %w", proxy.ErrUpstreamProtocol, err), proxy.ClassProtocol, false
	}
	switch c := proxy.VerdictFor(err).Class; c {
	case proxy.ClassConnect:
		return err, c, true
	case proxy.ClassTLS, proxy.ClassTimeout, proxy.ClassProtocol:
		return err, c, false
	}
	var ne net.Error
	if errors.Is(err, context.DeadlineExceeded) || errors.As(err, &ne) && ne.Timeout() {
		return fmt.Errorf("%w: %w", proxy.ErrUpstreamTimeout, err), proxy.ClassTimeout, false
	}
	return fmt.Errorf("%w: %w", proxy.ErrUpstreamProtocol, err), proxy.ClassProtocol, false
}
