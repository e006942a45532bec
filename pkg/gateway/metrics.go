package gateway

import (
	"errors"
	"strconv"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/loxilb-llm/loxilb/pkg/proxy"
	"github.com/loxilb-llm/loxilb/pkg/tokenizer"
)

type metrics struct {
	tokMissing   *prometheus.CounterVec
	unhashableC  *prometheus.CounterVec
	missC        *prometheus.CounterVec
	predicted    *prometheus.CounterVec
	actual       *prometheus.CounterVec
	mispredicted *prometheus.CounterVec
	unverified   *prometheus.CounterVec
	coalesced    *prometheus.CounterVec
	coalesceWait *prometheus.HistogramVec
	admitted     *prometheus.CounterVec
	admitWait    *prometheus.HistogramVec
	rejectedC    *prometheus.CounterVec
	tokWaiting   prometheus.Gauge
	// ejectedSkipped counts picks that left an ejected endpoint out.
	ejectedSkipped *prometheus.CounterVec
	rankTargeted   *prometheus.CounterVec
	// rankSeeded counts requests sent to a rank holding none of their
	// prompt to warm it (rankseed.go).
	rankSeeded *prometheus.CounterVec
	// untrustedSkipped counts Tier-1.5 decisions that left an endpoint
	// out under strict attestation.
	untrustedSkipped *prometheus.CounterVec
	// modelImplied counts requests without a model tokenized for the
	// only staged one.
	modelImplied *prometheus.CounterVec
	// duplicateLeaders counts other nodes' announcements of blocks a
	// forwarded request of this node was computing at the same endpoint
	// (remote.go); tieBreak counts the deferrals of tiebreak.go.
	duplicateLeaders *prometheus.CounterVec
	tieBreak         *prometheus.CounterVec
}

// waitBuckets spans the gateway's waits: a millisecond to a few prefills
// on a busy engine and the 10 s beyond any default bound.
var waitBuckets = []float64{0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10}

func newMetrics(reg prometheus.Registerer) (*metrics, error) {
	m := &metrics{
		tokMissing: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "loxilb_gateway_tokenizer_unavailable_total",
			Help: "Requests whose model had no loadable staged tokenizer, so Tier 1.5 was skipped; by reason (not_staged, unreadable, invalid, invalid_model_name). model is \"other\" for names no rule serves and no staged tokenizer matches."},
			[]string{"service", "model", "reason"}),
		unhashableC: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "loxilb_gateway_unhashable_requests_total",
			Help: "Requests whose engine block hash includes more than token ids (LoRA, cache_salt, multimodal), routed by the fallback selector."},
			[]string{"service", "reason"}),
		missC: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "loxilb_gateway_kv_skipped_total",
			Help: "Requests on KV-exact rules that skipped Tier 1.5 before scoring, by reason."}, []string{"service", "reason"}),
		predicted: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "loxilb_pd_kv_predicted_cached_tokens_total",
			Help: "Prompt tokens the router predicted the chosen endpoint had cached (closed-loop check)."}, []string{"service", "ep_idx"}),
		actual: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "loxilb_pd_kv_reported_cached_tokens_total",
			Help: "Prompt tokens the engine reported as cached (usage.prompt_tokens_details.cached_tokens)."}, []string{"service", "ep_idx"}),
		mispredicted: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "loxilb_pd_kv_mispredictions_total",
			Help: "Responses whose reported cached tokens differ from the prediction by at least one block, by direction (over: predicted more than served)."},
			[]string{"service", "ep_idx", "direction"}),
		unverified: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "loxilb_pd_kv_unverified_responses_total",
			Help: "Successful responses that carried no cached_tokens, so the prediction could not be checked."}, []string{"service", "ep_idx"}),
		coalesced: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "loxilb_kv_coalesced_total",
			Help: "Requests held until an earlier request finished computing the prompt prefix they share on the chosen endpoint, by how the wait ended (released, timeout, cancelled)."},
			[]string{"service", "ep_idx", "outcome"}),
		coalesceWait: prometheus.NewHistogramVec(prometheus.HistogramOpts{Name: "loxilb_kv_coalesce_wait_seconds",
			Help:    "How long coalesced requests waited for the shared prefix's prefill.",
			Buckets: waitBuckets}, []string{"service"}),
		admitted: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "loxilb_kv_prefill_admitted_total",
			Help: "Requests through the prefill admission queue (LOXILB_KV_PREFILL_SLOTS), by how they got through (immediate, queued, timeout, inherited, cancelled)."},
			[]string{"service", "ep_idx", "outcome"}),
		admitWait: prometheus.NewHistogramVec(prometheus.HistogramOpts{Name: "loxilb_kv_prefill_queue_wait_seconds",
			Help:    "How long requests that found no free prefill slot waited in the gateway.",
			Buckets: waitBuckets}, []string{"service"}),
		rejectedC: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "loxilb_gateway_rejected_requests_total",
			Help: "Mode-4 requests refused with 400 before routing, by reason (model_name_too_long: longer than --proxy-max-model-name; prompt_too_long: past --tokenize-max-bytes or the token bound)."},
			[]string{"service", "reason"}),
		tokWaiting: prometheus.NewGauge(prometheus.GaugeOpts{Name: "loxilb_gateway_tokenize_waiting",
			Help: "Requests waiting for a tokenization slot (--tokenize-concurrency)."}),
		ejectedSkipped: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "loxilb_gateway_ejected_skipped_total",
			Help: "Requests routed around an endpoint because passive health checking had ejected it."},
			[]string{"service", "ep_idx"}),
		rankTargeted: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "loxilb_kv_rank_targeted_total",
			Help: "Requests sent to a named data-parallel rank of their endpoint (SGLang routed_dp_rank/data_parallel_rank, vLLM X-data-parallel-rank), by rank."},
			[]string{"service", "ep_idx", "rank"}),
		rankSeeded: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "loxilb_kv_rank_seeds_total",
			Help: "Requests sent to a data-parallel rank holding none of their prompt, to warm it, instead of the busier rank holding their prefix, by the rank seeded."},
			[]string{"service", "ep_idx", "rank"}),
		untrustedSkipped: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "loxilb_gateway_kv_untrusted_skipped_total",
			Help: "Tier-1.5 decisions that left a healthy endpoint out because strict attestation (kvParityStrict, --kv-parity-strict) distrusts its parity verdict, by verdict (hash_mismatch, block_size_mismatch, hash_algo_mismatch)."},
			[]string{"service", "ep_idx", "verdict"}),
		modelImplied: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "loxilb_gateway_model_implied_total",
			Help: "Requests on KV-exact rules without model_name that named no model and were tokenized for the only staged tokenizer's model."},
			[]string{"service"}),
		duplicateLeaders: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "loxilb_cluster_prefill_duplicate_leaders_total",
			Help: "Another gateway node's prefill announcement for blocks a request of this node was already computing at the same endpoint: both nodes sent the prefix for prefill (counted on each node that sees the other's announcement, so a pair of nodes counts up to 2)."},
			[]string{"service"}),
		tieBreak: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "loxilb_cluster_prefill_tiebreak_total",
			Help: "Requests leading a new prefill that deferred before forwarding for another node's announcement of the same blocks (LOXILB_KV_CLUSTER_TIEBREAK_MS), by outcome (yielded: waited for the better-ranked node's prefill; kept: none came; cancelled)."},
			[]string{"service", "outcome"}),
	}
	if reg != nil {
		for _, c := range []prometheus.Collector{m.tokMissing, m.unhashableC, m.missC, m.predicted, m.actual, m.mispredicted, m.unverified, m.coalesced, m.coalesceWait, m.admitted, m.admitWait, m.rejectedC, m.tokWaiting, m.ejectedSkipped, m.rankTargeted, m.rankSeeded, m.untrustedSkipped, m.modelImplied, m.duplicateLeaders, m.tieBreak} {
			if err := reg.Register(c); err != nil {
				return nil, err
			}
		}
	}
	return m, nil
}

func (m *metrics) tokenizerMissing(service, model string, err error) {
	reason := "invalid"
	switch {
	case errors.Is(err, tokenizer.ErrNotStaged):
		reason = "not_staged"
	case errors.Is(err, tokenizer.ErrUnreadable):
		reason = "unreadable"
	case errors.Is(err, tokenizer.ErrInvalidModelName):
		reason = "invalid_model_name"
	}
	m.tokMissing.WithLabelValues(service, model, reason).Inc()
}

func (m *metrics) unhashable(service, why string) {
	m.unhashableC.WithLabelValues(service, why).Inc()
}

func (m *metrics) missed(service, reason string) { m.missC.WithLabelValues(service, reason).Inc() }

func (m *metrics) rejected(service, reason string) {
	m.rejectedC.WithLabelValues(service, reason).Inc()
}

// closedLoop compares the router's prediction with what the engine served.
// blockSize tolerance: engines report cached tokens of full blocks only.
func (m *metrics) closedLoop(service string, res proxy.Result, predicted int64) {
	if res.Status/100 != 2 || res.Endpoint < 0 {
		return
	}
	ep := strconv.Itoa(res.Endpoint)
	if !res.HasCachedTokens {
		m.unverified.WithLabelValues(service, ep).Inc()
		return
	}
	m.predicted.WithLabelValues(service, ep).Add(float64(predicted))
	m.actual.WithLabelValues(service, ep).Add(float64(res.CachedTokens))
	switch {
	case res.CachedTokens < predicted:
		m.mispredicted.WithLabelValues(service, ep, "over").Inc()
	case res.CachedTokens > predicted:
		m.mispredicted.WithLabelValues(service, ep, "under").Inc()
	}
}

func (m *metrics) forget(service string) {
	for _, v := range []*prometheus.CounterVec{m.unhashableC, m.missC, m.predicted, m.actual, m.mispredicted, m.unverified, m.tokMissing, m.coalesced, m.admitted, m.rejectedC, m.ejectedSkipped, m.rankTargeted, m.rankSeeded, m.untrustedSkipped, m.modelImplied, m.duplicateLeaders, m.tieBreak} {
		v.DeletePartialMatch(prometheus.Labels{"service": service})
	}
	m.coalesceWait.DeletePartialMatch(prometheus.Labels{"service": service})
	m.admitWait.DeletePartialMatch(prometheus.Labels{"service": service})
}
