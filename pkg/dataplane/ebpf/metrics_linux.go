//go:build linux

package ebpf

import (
	"context"
	"strconv"

	"github.com/prometheus/client_golang/prometheus"
)

// collector exports the BPF counters at scrape time.
type collector struct {
	d                          *Dataplane
	verdicts, pkts, bytes, new *prometheus.Desc
	evicted, ct, stale         *prometheus.Desc
}

func newCollector(d *Dataplane) *collector {
	return &collector{
		d:        d,
		verdicts: prometheus.NewDesc("loxilb_dataplane_packets_total", "Packets seen by the eBPF data plane, by verdict or drop reason.", []string{"reason"}, nil),
		pkts: prometheus.NewDesc("loxilb_dataplane_service_packets_total",
			"Packets of a service's flows, both directions, as of the last conntrack GC pass.", []string{"service"}, nil),
		bytes: prometheus.NewDesc("loxilb_dataplane_service_bytes_total",
			"Bytes of a service's flows, both directions, as of the last conntrack GC pass.", []string{"service"}, nil),
		new: prometheus.NewDesc("loxilb_dataplane_service_flows_total", "Connections created for a service.", []string{"service"}, nil),
		evicted: prometheus.NewDesc("loxilb_dataplane_service_conntrack_evicted_total",
			"Conntrack entries of a service lost to eviction from a full table; their packets and bytes are missing from the service's totals.", []string{"service"}, nil),
		ct: prometheus.NewDesc("loxilb_dataplane_conntrack_entries", "Conntrack entries after the last GC pass (two per NATed flow).", nil, nil),
		stale: prometheus.NewDesc("loxilb_dataplane_stale_services_removed_total",
			"Services left in the pinned maps by a previous run that the rule store does not hold, removed at start.", nil, nil),
	}
}

func (c *collector) Describe(ch chan<- *prometheus.Desc) {
	ch <- c.verdicts
	ch <- c.pkts
	ch <- c.bytes
	ch <- c.new
	ch <- c.evicted
	ch <- c.ct
	ch <- c.stale
}

func (c *collector) Collect(ch chan<- prometheus.Metric) {
	st, err := c.d.Stats(context.Background())
	if err != nil {
		ch <- prometheus.NewInvalidMetric(c.verdicts, err)
		return
	}
	for name, v := range st.Counters {
		ch <- prometheus.MustNewConstMetric(c.verdicts, prometheus.CounterValue, float64(v), name)
	}
	for id, s := range st.Services {
		l := strconv.FormatUint(uint64(id), 10)
		ch <- prometheus.MustNewConstMetric(c.pkts, prometheus.CounterValue, float64(s.Packets), l)
		ch <- prometheus.MustNewConstMetric(c.bytes, prometheus.CounterValue, float64(s.Bytes), l)
		ch <- prometheus.MustNewConstMetric(c.new, prometheus.CounterValue, float64(s.Flows), l)
		ch <- prometheus.MustNewConstMetric(c.evicted, prometheus.CounterValue, float64(s.Evicted), l)
	}
	ch <- prometheus.MustNewConstMetric(c.ct, prometheus.GaugeValue, float64(st.ConntrackEntries))
	ch <- prometheus.MustNewConstMetric(c.stale, prometheus.CounterValue, float64(c.d.StaleServicesRemoved()))
}
