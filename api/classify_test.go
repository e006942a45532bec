package api_test

import (
	"context"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"strings"
	"syscall"
	"testing"

	"github.com/loxilb-llm/loxilb/api"
	"github.com/loxilb-llm/loxilb/pkg/control"
	"github.com/loxilb-llm/loxilb/pkg/lbrule"
	"github.com/loxilb-llm/loxilb/pkg/proxy"
	"github.com/loxilb-llm/loxilb/pkg/store"
)

// failingRules answers every create with err, as a stage would.
type failingRules struct{ err error }

func (f failingRules) Create(context.Context, []byte) (control.Service, bool, error) {
	return control.Service{}, false, f.err
}
func (failingRules) Delete(context.Context, lbrule.Key) error          { return nil }
func (failingRules) DeleteByName(context.Context, string) (int, error) { return 0, nil }
func (failingRules) List() []control.Service                           { return nil }
func (failingRules) Get(uint32) (control.Service, bool)                { return control.Service{}, false }

func listenErr(errno syscall.Errno) error {
	op := &net.OpError{Op: "listen", Net: "tcp", Err: os.NewSyscallError("bind", errno)}
	inner := fmt.Errorf("%w: service 1: listen on 127.0.0.10:80: %w", proxy.ErrListen, op)
	return fmt.Errorf("%w: %w", control.ErrApply, fmt.Errorf("gateway: %w", inner))
}

// TestStageErrorsAreTyped: configuration mistakes found by a stage (the
// VIP:port held by another process, a TLS rule without a certificate) are
// 4xx with a reason code, never 500.
func TestStageErrorsAreTyped(t *testing.T) {
	for _, c := range []struct {
		name   string
		err    error
		code   int
		reason string
	}{
		{"vip port in use", listenErr(syscall.EADDRINUSE), http.StatusConflict, api.ReasonVIPPortInUse},
		{"vip not local", listenErr(syscall.EADDRNOTAVAIL), http.StatusBadRequest, api.ReasonVIPNotLocal},
		{"privileged port", listenErr(syscall.EACCES), http.StatusPreconditionFailed, api.ReasonListenPermission},
		{"tls without cert", fmt.Errorf("%w: gateway: %w", control.ErrApply, &lbrule.RuleError{Class: lbrule.ErrPrecondition,
			Field: "serviceArguments.security", Reason: lbrule.ReasonProxyTLSUnset, Msg: "needs --proxy-tls-cert"}), http.StatusPreconditionFailed, lbrule.ReasonProxyTLSUnset},
		{"kernel rule without interfaces", fmt.Errorf("%w: dataplane: %w", control.ErrApply, control.KernelUnavailable{Code: control.ReasonNoInterfaces, Why: "no interface"}.Reconcile(
			context.Background(), []control.Service{{ID: 1, Rule: &lbrule.Rule{Service: lbrule.ServiceArgs{ExternalIP: "127.0.9.9", Port: 80, Protocol: "tcp"}}}})),
			http.StatusPreconditionFailed, control.ReasonNoInterfaces},
		{"shared store unreachable", fmt.Errorf("allocate rule id: %w", &store.UnavailableError{Backend: "etcd 127.0.0.1:2379", Err: context.DeadlineExceeded}),
			http.StatusServiceUnavailable, api.ReasonStoreUnavailable},
		{"rule too large for the shared store", fmt.Errorf("persist rule 3: %w", store.ErrTooLarge), http.StatusRequestEntityTooLarge, api.ReasonStoreTooLarge},
	} {
		t.Run(c.name, func(t *testing.T) {
			srv, err := api.New(api.Config{}, api.Deps{Rules: failingRules{c.err}})
			if err != nil {
				t.Fatal(err)
			}
			rec := httptest.NewRecorder()
			srv.Handler().ServeHTTP(rec, httptest.NewRequest(http.MethodPost, api.BasePath+"/config/loadbalancer", strings.NewReader("{}")))
			var b api.ErrorBody
			_ = json.Unmarshal(rec.Body.Bytes(), &b)
			if rec.Code != c.code || b.ReasonCode != c.reason {
				t.Fatalf("%d %+v, want %d %s", rec.Code, b, c.code, c.reason)
			}
		})
	}
}
