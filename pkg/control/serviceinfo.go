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

// ServiceInfoCollector exports loxilb_service_info for the controller's
// current rules (a scrape during a rule change waits for it, as List does).
func ServiceInfoCollector(c *Controller) prometheus.Collector { return serviceInfo{c} }

type serviceInfo struct{ c *Controller }

func (s serviceInfo) Describe(ch chan<- *prometheus.Desc) { ch <- serviceInfoDesc }

func (s serviceInfo) Collect(ch chan<- prometheus.Metric) {
	for _, svc := range s.c.List() {
		a := svc.Rule.Service
		ch <- prometheus.MustNewConstMetric(serviceInfoDesc, prometheus.GaugeValue, 1,
			strconv.FormatUint(uint64(svc.ID), 10), a.Name, a.ExternalIP, strconv.Itoa(a.Port), a.Protocol, strconv.Itoa(a.Mode))
	}
}
