package api

import (
	"strings"

	"github.com/prometheus/client_golang/prometheus"
)

// capabilityReadyDesc exports GET /status/capabilities as a gauge, so an
// alert can watch the readiness of gated features (the eBPF data plane,
// vLLM KV-exact routing, tokenizers) without polling the API.
var capabilityReadyDesc = prometheus.NewDesc("loxilb_capability_ready",
	"1 when the capability is ready, 0 when not; reason_code says why not (ebpf_dataplane: disabled, unavailable, no_interfaces). Per-endpoint parity and quarantine entries are exported as loxilb_kv_parity_verdict and loxilb_kv_quarantined instead.",
	[]string{"capability", "reason_code"}, nil)

// capabilityCollector reads the capability source at scrape time.
type capabilityCollector struct{ src CapabilitySource }

var _ prometheus.Collector = capabilityCollector{}

func (c capabilityCollector) Describe(ch chan<- *prometheus.Desc) { ch <- capabilityReadyDesc }

func (c capabilityCollector) Collect(ch chan<- prometheus.Metric) {
	for _, cp := range c.src() {
		// kv_parity:<svc>/<ep> and kv_quarantine:<svc>/<ep> would put a
		// service and an endpoint inside a label value; their own metrics
		// carry them as service and ep_idx.
		// rule_field:<field> entries are a catalogue of inert rule fields,
		// not something that can become ready.
		if strings.HasPrefix(cp.Name, "kv_parity:") || strings.HasPrefix(cp.Name, "kv_quarantine:") || strings.HasPrefix(cp.Name, InertCapabilityPrefix) {
			continue
		}
		v := 0.0
		if cp.Ready {
			v = 1
		}
		ch <- prometheus.MustNewConstMetric(capabilityReadyDesc, prometheus.GaugeValue, v, cp.Name, cp.ReasonCode)
	}
}
