package health

import "github.com/loxilb-llm/loxilb/pkg/control"

// EndpointState renders an endpoint's health for rule read-back (the
// API's endpoint "state"): "active" or "inactive" for an endpoint its rule
// monitors, "" for one it does not, whose health nothing measures, and for
// a rule services does not hold.
func EndpointState(h interface{ Healthy(uint32, int) bool }, services func(uint32) (control.Service, bool)) func(uint32, int) string {
	return func(service uint32, ep int) string {
		s, ok := services(service)
		if !ok || !MonitorEnabled(s.Rule.Service.Monitor, s.Rule.Service.ProbeType) {
			return ""
		}
		if h.Healthy(service, ep) {
			return "active"
		}
		return "inactive"
	}
}
