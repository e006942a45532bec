package api

import (
	"errors"
	"net/http"
	"syscall"

	"github.com/loxilb-llm/loxilb/pkg/control"
	"github.com/loxilb-llm/loxilb/pkg/lbrule"
)

// Sentinels of the API layer itself.
var (
	errUnauthorized = errors.New("missing bearer token: send Authorization: Bearer <token>")
	errForbidden    = errors.New("bearer token rejected")
	errBadRequest   = errors.New("bad request")
	errNotFound     = errors.New("not found")
	errUnavailable  = errors.New("unavailable")
)

// statusOf is the one error-to-status mapping of this server. It branches on
// error identity only, never on message text.
func statusOf(err error) int {
	switch {
	case errors.Is(err, errUnauthorized):
		return http.StatusUnauthorized
	case errors.Is(err, errForbidden):
		return http.StatusForbidden
	case errors.Is(err, lbrule.ErrInvalid), errors.Is(err, errBadRequest):
		return http.StatusBadRequest
	case errors.Is(err, lbrule.ErrConflict):
		return http.StatusConflict
	case errors.Is(err, lbrule.ErrPrecondition):
		return http.StatusPreconditionFailed
	case errors.Is(err, lbrule.ErrNotFound), errors.Is(err, errNotFound):
		return http.StatusNotFound
	case errors.Is(err, errUnavailable):
		return http.StatusServiceUnavailable
	case errors.Is(err, control.ErrApply) && errors.Is(err, syscall.EADDRINUSE):
		// Another process (or rule) holds the VIP:port.
		return http.StatusConflict
	case errors.Is(err, control.ErrApply) && errors.Is(err, syscall.EADDRNOTAVAIL):
		// The VIP is not local and no data plane makes it so.
		return http.StatusBadRequest
	}
	return http.StatusInternalServerError
}

func errorBody(err error) ErrorBody {
	b := ErrorBody{Code: statusOf(err), Message: err.Error()}
	var re *lbrule.RuleError
	if errors.As(err, &re) {
		b.Field, b.ReasonCode = re.Field, re.Reason
	}
	return b
}
