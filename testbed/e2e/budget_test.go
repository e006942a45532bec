package e2e

import (
	"testing"
	"time"

	"github.com/loxilb-llm/loxilb/testbed/enginesim"
)

// TestPrefillQueueLearnsBudgetByDefault: with no prefill setting at all,
// the daemon reads an SGLang engine's sequence cap from its server info,
// shows it in the inventory API and the metrics, and queues requests on
// it: a second cold prompt waits in the gateway while the first holds the
// engine's only sequence.
func TestPrefillQueueLearnsBudgetByDefault(t *testing.T) {
	p := newPool(t, poolOpts{n: 1, net: 63, kvEngine: "sglang", env: []string{"LOXILB_KV_COALESCE_WAIT_MS=0"},
		engine: func(_ int, c *enginesim.Config) {
			c.TimeScale, c.PrefillUsPerToken, c.MaxRunning = 1, 2000, 1 // a cold ~600-token prompt holds the engine ~1.2s
		}})
	type budget struct {
		PrefillSlots *struct {
			Slots  int
			Source string
		} `json:"prefill_slots"`
	}
	waitFor(t, "the engine's budget in the inventory API", 10*time.Second, func() bool {
		var inv budget
		getJSON(t, p.d.URL("/config/ai/kv/inventory?service_id=1&ep_idx=0"), &inv)
		return inv.PrefillSlots != nil && inv.PrefillSlots.Slots == 1 && inv.PrefillSlots.Source == "server_info"
	})
	if v := metricValue(metrics(t, p.d), "loxilb_kv_prefill_slots{", `source="server_info"`); v != 1 {
		t.Fatalf("loxilb_kv_prefill_slots{source=server_info} = %v, want 1", v)
	}

	finished := make(chan route, 2)
	send := func(prompt string) { go func() { finished <- complete(t, p.vip, prompt) }() }
	send(longPrompt("first cold", 1))
	waitFor(t, "the first cold prompt to take the slot", 10*time.Second, func() bool {
		return metricValue(metrics(t, p.d), "loxilb_kv_prefill_slots_busy") == 1
	})
	send(longPrompt("second cold", 2))
	waitFor(t, "the second cold prompt to queue in the gateway", 10*time.Second, func() bool {
		return metricValue(metrics(t, p.d), "loxilb_kv_prefill_queue_depth") == 1
	})
	<-finished
	<-finished
	if v := metricValue(metrics(t, p.d), "loxilb_kv_prefill_admitted_total", `outcome="queued"`); v != 1 {
		t.Fatalf("admitted{queued} = %v, want 1", v)
	}
}
