package api

import (
	"errors"
	"net/http"
	"syscall"

	"github.com/loxilb-llm/loxilb/pkg/control"
	"github.com/loxilb-llm/loxilb/pkg/lbrule"
	"github.com/loxilb-llm/loxilb/pkg/proxy"
	"github.com/loxilb-llm/loxilb/pkg/store"
)

// Sentinels of the API layer itself.
var (
	errUnauthorized = errors.New("missing bearer token: send Authorization: Bearer <token>")
	errForbidden    = errors.New("bearer token rejected")
	errBadRequest   = errors.New("bad request")
	errNotFound     = errors.New("not found")
	errUnavailable  = errors.New("unavailable")
	errBodyTooLarge = errors.New("request body too large")
	errBodyTimeout  = errors.New("request body timed out")
)

// Reason codes of errors that carry no lbrule.RuleError; stable and
// documented in openapi.json.
const (
	ReasonVIPPortInUse     = proxy.ReasonVIPPortInUse
	ReasonVIPNotLocal      = proxy.ReasonVIPNotLocal
	ReasonListenPermission = proxy.ReasonListenPermission
	ReasonBodyTooLarge     = "API_BODY_TOO_LARGE"
	ReasonBodyTimeout      = "API_BODY_TIMEOUT"
	// ReasonStoreUnavailable: the shared rule store (etcd) cannot be
	// reached; rules are not changed, the ones applied keep serving.
	ReasonStoreUnavailable = "STORE_UNAVAILABLE"
	// ReasonStoreTooLarge: the rule is larger than the shared store takes
	// in one request (etcd's --max-request-bytes).
	ReasonStoreTooLarge = "STORE_RECORD_TOO_LARGE"
	reasonNone          = ""
)

// classify is the one error-to-status mapping of this server, with the
// reason code of the errors that do not carry one. It branches on error
// identity only, never on message text.
func classify(err error) (int, string) {
	listen := errors.Is(err, proxy.ErrListen) || errors.Is(err, control.ErrApply)
	switch {
	case errors.Is(err, errUnauthorized):
		return http.StatusUnauthorized, reasonNone
	case errors.Is(err, errForbidden):
		return http.StatusForbidden, reasonNone
	case errors.Is(err, errBodyTooLarge):
		return http.StatusRequestEntityTooLarge, ReasonBodyTooLarge
	case errors.Is(err, errBodyTimeout):
		return http.StatusRequestTimeout, ReasonBodyTimeout
	case errors.Is(err, lbrule.ErrInvalid), errors.Is(err, errBadRequest):
		return http.StatusBadRequest, reasonNone
	case errors.Is(err, lbrule.ErrConflict):
		return http.StatusConflict, reasonNone
	case errors.Is(err, lbrule.ErrPrecondition):
		return http.StatusPreconditionFailed, reasonNone
	case errors.Is(err, lbrule.ErrNotFound), errors.Is(err, errNotFound):
		return http.StatusNotFound, reasonNone
	case errors.Is(err, errUnavailable):
		return http.StatusServiceUnavailable, reasonNone
	case errors.Is(err, store.ErrUnavailable):
		return http.StatusServiceUnavailable, ReasonStoreUnavailable
	case errors.Is(err, store.ErrTooLarge):
		return http.StatusRequestEntityTooLarge, ReasonStoreTooLarge
	case listen && errors.Is(err, syscall.EADDRINUSE):
		// Another process (or rule) holds the VIP:port.
		return http.StatusConflict, ReasonVIPPortInUse
	case listen && errors.Is(err, syscall.EADDRNOTAVAIL):
		// The VIP is not local and no data plane makes it so.
		return http.StatusBadRequest, ReasonVIPNotLocal
	case listen && (errors.Is(err, syscall.EACCES) || errors.Is(err, syscall.EPERM)):
		// A port below 1024 without CAP_NET_BIND_SERVICE.
		return http.StatusPreconditionFailed, ReasonListenPermission
	}
	return http.StatusInternalServerError, reasonNone
}

func errorBody(err error) ErrorBody {
	code, reason := classify(err)
	b := ErrorBody{Code: code, Message: err.Error(), ReasonCode: reason}
	var re *lbrule.RuleError
	if errors.As(err, &re) {
		b.Field = re.Field
		if re.Reason != "" {
			b.ReasonCode = re.Reason
		}
	}
	var ce *control.RuleError
	if b.ReasonCode == "" && errors.As(err, &ce) {
		// A stage's report on the rule (EBPF_RULE_NOT_INSTALLED, ...).
		b.ReasonCode = ce.Reason
	}
	return b
}
