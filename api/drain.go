package api

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"strconv"
	"strings"

	"github.com/gin-gonic/gin"

	"github.com/loxilb-llm/loxilb/pkg/control"
	"github.com/loxilb-llm/loxilb/pkg/lbrule"
)

// Drainer is the part of the rule table that keeps endpoints in
// maintenance (*control.Controller).
type Drainer interface {
	SetDrain(ctx context.Context, k lbrule.Key, addr string, on bool) (control.DrainState, error)
	Drain(k lbrule.Key, addr string) (control.DrainState, error)
}

// drainPath is the route of one endpoint's maintenance state, under the
// rule's delete route.
const drainPath = "/config/loadbalancer/externalipaddress/:ip/port/:port/protocol/:proto/endpoint/:epip/port/:epport/drain"

// drain answers GET (read), POST (start draining) and DELETE (back in
// service) on drainPath.
func (s *Server) drain(c *gin.Context) {
	d, ok := s.deps.Rules.(Drainer)
	if !ok {
		s.fail(c, fmt.Errorf("%w: endpoint maintenance is not available", errUnavailable))
		return
	}
	k, err := ruleKey(c)
	if err != nil {
		s.fail(c, err)
		return
	}
	epport, err := strconv.Atoi(c.Param("epport"))
	if err != nil || epport < 1 || epport > 65535 {
		s.fail(c, fmt.Errorf("%w: endpoint port %q is not a number in 1..65535", errBadRequest, c.Param("epport")))
		return
	}
	epip := net.ParseIP(c.Param("epip"))
	if epip == nil {
		s.fail(c, fmt.Errorf("%w: endpoint %q is not an IP address", errBadRequest, c.Param("epip")))
		return
	}
	addr := net.JoinHostPort(canonical(epip), strconv.Itoa(epport))
	var st control.DrainState
	switch c.Request.Method {
	case http.MethodGet:
		st, err = d.Drain(k, addr)
	default:
		st, err = d.SetDrain(c.Request.Context(), k, addr, c.Request.Method == http.MethodPost)
	}
	if err != nil {
		s.fail(c, err)
		return
	}
	out := EndpointDrain{ServiceID: st.Service.ID, EPIdx: st.EPIdx, Endpoint: st.Endpoint, Draining: st.Draining, Changed: st.Changed}
	if s.deps.InFlight != nil && st.Service.Rule.Service.Mode == lbrule.ModeFullProxy {
		n := s.deps.InFlight(st.Service.ID, st.EPIdx)
		out.InFlight = &n
	}
	c.JSON(http.StatusOK, out)
}

// ruleKey reads a rule key from the :ip, :port, :proto parameters and the
// optional ?block= mark.
func ruleKey(c *gin.Context) (lbrule.Key, error) {
	port, err := strconv.Atoi(c.Param("port"))
	if err != nil || port < 0 || port > 65535 {
		return lbrule.Key{}, fmt.Errorf("%w: port %q is not a number in 0..65535", errBadRequest, c.Param("port"))
	}
	ip := net.ParseIP(c.Param("ip"))
	if ip == nil {
		return lbrule.Key{}, fmt.Errorf("%w: %q is not an IP address", errBadRequest, c.Param("ip"))
	}
	block := 0
	if b := c.Query("block"); b != "" {
		if block, err = strconv.Atoi(b); err != nil {
			return lbrule.Key{}, fmt.Errorf("%w: block %q is not a number", errBadRequest, b)
		}
	}
	return lbrule.Key{IP: canonical(ip), Port: port, Proto: strings.ToLower(c.Param("proto")), Block: block}, nil
}
