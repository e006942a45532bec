package gateway

import (
	"strconv"

	"github.com/prometheus/client_golang/prometheus"
)

// Sources of a prefill budget: the "source" label of loxilb_kv_prefill_slots
// and the inventory API's prefill_slots.source. A learned budget carries
// the source its SlotLearner names (pkg/enginemetrics: "server_info",
// "observed").
const (
	BudgetConfigured = "configured" // LOXILB_KV_PREFILL_SLOTS=N
	BudgetNone       = "none"       // auto, nothing learned yet: admits freely
	BudgetOff        = "off"        // LOXILB_KV_PREFILL_SLOTS=0
)

// SlotLearner supplies learned per-endpoint budgets
// (*enginemetrics.Scraper, which learns them from the engines).
type SlotLearner interface {
	// LearnedSlots returns the endpoint's concurrent-sequence budget and
	// where it came from; ok=false while none is known.
	LearnedSlots(service uint32, ep int) (slots int, source string, ok bool)
}

// PrefillBudget returns the prefill admission budget the gateway applies
// to an endpoint and its source (the learner's, BudgetConfigured,
// BudgetNone or BudgetOff). 0 slots: requests are not
// queued.
func (g *Gateway) PrefillBudget(service uint32, ep int) (int, string) {
	return g.prefill.budget(service, ep)
}

var prefillSlotsDesc = prometheus.NewDesc("loxilb_kv_prefill_slots",
	"Prefill admission budget per endpoint (requests forwarded before their first byte), by source: server_info or observed (learned), configured (LOXILB_KV_PREFILL_SLOTS=N), none (not learned yet: not queued), off.",
	[]string{"service", "ep_idx", "source"}, nil)

// slotsCollector exports every queued endpoint's budget at scrape time.
type slotsCollector struct{ g *Gateway }

// Describe implements prometheus.Collector.
func (c slotsCollector) Describe(ch chan<- *prometheus.Desc) { ch <- prefillSlotsDesc }

// Collect implements prometheus.Collector: one sample per endpoint of each
// KV-exact single-pool rule (the rules whose requests are queued).
func (c slotsCollector) Collect(ch chan<- prometheus.Metric) {
	for id, st := range *c.g.table.Load() {
		if st.hasher == nil || st.rule.Service.PDDisagg {
			continue
		}
		for ep := range st.addrs {
			n, src := c.g.PrefillBudget(id, ep)
			ch <- prometheus.MustNewConstMetric(prefillSlotsDesc, prometheus.GaugeValue, float64(n), st.label, strconv.Itoa(ep), src)
		}
	}
}
