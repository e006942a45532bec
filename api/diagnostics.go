package api

import (
	"context"
	"fmt"
	"net/http"
	"strconv"

	"github.com/gin-gonic/gin"

	"github.com/loxilb-llm/loxilb/pkg/diag"
)

// DiagnosticsPath is the read-only preflight of the KV-exact rules.
const DiagnosticsPath = "/diagnostics"

// Diagnose runs the preflight checks of every KV-exact rule, or of service
// only when only is true (diag.Sources.Run).
type Diagnose func(ctx context.Context, service uint32, only bool) []diag.Check

// Diagnostics is the answer of GET /diagnostics: one line per check, and
// the counts by result. The status is 200 whatever the results; Failed
// tells a caller (loxicmd exits non-zero on it) that a check failed.
type Diagnostics struct {
	Checks []diag.Check `json:"checks"`
	Pass   int          `json:"pass"`
	Warn   int          `json:"warn"`
	Fail   int          `json:"fail"`
	Failed bool         `json:"failed"`
}

func (s *Server) diagnostics(c *gin.Context) {
	var id uint32
	only := false
	if v := c.Query("service"); v != "" {
		n, err := strconv.ParseUint(v, 10, 32)
		if err != nil {
			s.fail(c, fmt.Errorf("%w: service must be a uint32 rule number (got %q)", errBadRequest, v))
			return
		}
		if _, ok := s.deps.Rules.Get(uint32(n)); !ok {
			s.fail(c, fmt.Errorf("%w: no service %d", errNotFound, n))
			return
		}
		id, only = uint32(n), true
	}
	if s.deps.Diagnose == nil {
		s.fail(c, fmt.Errorf("%w: diagnostics are not wired in this server", errUnavailable))
		return
	}
	out := Diagnostics{Checks: s.deps.Diagnose(c.Request.Context(), id, only)}
	if out.Checks == nil {
		out.Checks = []diag.Check{}
	}
	for _, ch := range out.Checks {
		switch ch.Result {
		case diag.Pass:
			out.Pass++
		case diag.Warn:
			out.Warn++
		case diag.Fail:
			out.Fail++
		}
	}
	out.Failed = out.Fail > 0
	c.JSON(http.StatusOK, out)
}
