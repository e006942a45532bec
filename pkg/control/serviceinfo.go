package control

import (
	"strconv"

	"github.com/prometheus/client_golang/prometheus"
)

// serviceInfoDesc is the join table of every per-service metric: all of them
// label a service by its numeric id (`service`) and an endpoint by its index
// in the rule (`ep_idx`), the identifiers of the inventory API; this series
// maps the id to what an operator recognises (rule name, VIP, port, mode).
var serviceInfoDesc = prometheus.NewDesc("loxilb_service_info",
	"Always 1, one series per rule: maps the numeric service label of every other metric to the rule's name, VIP, port, protocol and mode.",
	[]string{"service", "name", "vip", "port", "protocol", "mode"}, nil)

// drainingDesc is each endpoint's maintenance state (see drain.go).
var drainingDesc = prometheus.NewDesc("loxilb_endpoint_draining",
	"1 while the endpoint is draining (in maintenance: no new requests or flows, those in flight finish), else 0; one series per endpoint of every rule.",
	[]string{"service", "ep_idx"}, nil)

// ServiceInfoCollector exports loxilb_service_info and
// loxilb_endpoint_draining for the controller's current rules (a scrape
// during a rule change waits for it, as List does).
func ServiceInfoCollector(c *Controller) prometheus.Collector { return serviceInfo{c} }

type serviceInfo struct{ c *Controller }

func (s serviceInfo) Describe(ch chan<- *prometheus.Desc) {
	ch <- serviceInfoDesc
	ch <- drainingDesc
}

func (s serviceInfo) Collect(ch chan<- prometheus.Metric) {
	for _, svc := range s.c.List() {
		a := svc.Rule.Service
		ch <- prometheus.MustNewConstMetric(serviceInfoDesc, prometheus.GaugeValue, 1,
			strconv.FormatUint(uint64(svc.ID), 10), a.Name, a.ExternalIP, strconv.Itoa(a.Port), a.Protocol, strconv.Itoa(a.Mode))
		for i := range svc.Rule.Endpoints {
			v := 0.0
			if svc.EndpointDraining(i) {
				v = 1
			}
			sid, ep := drainingLabels(svc.ID, i)
			ch <- prometheus.MustNewConstMetric(drainingDesc, prometheus.GaugeValue, v, sid, ep)
		}
	}
}
