package kvindex

import (
	"fmt"

	"github.com/prometheus/client_golang/prometheus"
)

type metrics struct {
	blocks    *prometheus.GaugeVec
	evictions *prometheus.CounterVec
	specDrops *prometheus.CounterVec
	rejected  *prometheus.CounterVec
}

func newMetrics(reg prometheus.Registerer) (*metrics, error) {
	m := &metrics{
		blocks: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "loxilb_pd_kv_blocks",
			Help: "Blocks in the KV inventory of an endpoint, from engine KV events (speculative entries excluded).",
		}, []string{"service", "ep_idx"}),
		evictions: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "loxilb_kv_inv_cap_evictions_total",
			Help: "Blocks evicted from an endpoint inventory because it reached its cap (oldest inserted first).",
		}, []string{"service", "ep_idx"}),
		specDrops: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "loxilb_kv_inv_speculative_dropped_total",
			Help: "Speculative entries not recorded because the endpoint's speculative cap was reached.",
		}, []string{"service", "ep_idx"}),
		rejected: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "loxilb_kv_inv_rejected_total",
			Help: "Inventory updates rejected, by reason (endpoint or rank index out of range).",
		}, []string{"service", "reason"}),
	}
	if reg == nil {
		return m, nil
	}
	for _, c := range []prometheus.Collector{m.blocks, m.evictions, m.specDrops, m.rejected} {
		if err := reg.Register(c); err != nil {
			return nil, fmt.Errorf("register kv index metrics (one Index per registerer): %w", err)
		}
	}
	return m, nil
}
