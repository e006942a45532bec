package dispatch

import (
	"github.com/prometheus/client_golang/prometheus"
)

// metrics are the P/D counters and histograms. Series are labelled by
// service (rule number) and endpoint (index in the rule), as the proxy's are.
type metrics struct {
	requests       *prometheus.CounterVec   // service, engine, outcome
	prefillDur     *prometheus.HistogramVec // service, endpoint
	decodeTTFT     *prometheus.HistogramVec // service, endpoint
	paramsFound    *prometheus.CounterVec   // service, endpoint
	paramsMissing  *prometheus.CounterVec   // service, endpoint
	paramsBad      *prometheus.CounterVec   // service, endpoint
	legErrors      *prometheus.CounterVec   // service, endpoint, leg, class
	legTimeouts    *prometheus.CounterVec   // service, endpoint, leg
	queued         *prometheus.CounterVec   // service, endpoint
	shed           *prometheus.CounterVec   // service, endpoint, reason
	failover       *prometheus.CounterVec   // service, endpoint (the one that failed)
	streamAborted  *prometheus.CounterVec   // service, endpoint
	earlyExit      *prometheus.CounterVec   // service
	prefillTier    *prometheus.CounterVec   // service, tier
	sessionHits    *prometheus.CounterVec   // service
	sessionsActive prometheus.Gauge
	trieKeys       prometheus.Gauge
	inflight       *prometheus.GaugeVec // service, endpoint
}

func newMetrics(reg prometheus.Registerer) (*metrics, error) {
	se := []string{"service", "ep_idx"}
	buckets := []float64{.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60}
	m := &metrics{
		requests: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "loxilb_ai_pd_requests_total",
			Help: "Prefill/decode requests by engine flow and outcome (ok, early_exit, shed, prefill_error, decode_error, params_missing, params_malformed, stream_aborted, client_canceled, unavailable, bad_request)."},
			[]string{"service", "engine", "outcome"}),
		prefillDur: prometheus.NewHistogramVec(prometheus.HistogramOpts{Name: "loxilb_ai_pd_prefill_duration_seconds",
			Help: "Duration of successful prefill (context) legs, from send to the complete response.", Buckets: buckets}, se),
		decodeTTFT: prometheus.NewHistogramVec(prometheus.HistogramOpts{Name: "loxilb_ai_pd_decode_ttft_seconds",
			Help: "Time from sending a decode (generation) leg to its first response body byte.", Buckets: buckets}, se),
		paramsFound: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "loxilb_ai_pd_kv_params_found_total",
			Help: "Prefill responses that carried usable transfer parameters (kv_transfer_params or disaggregated_params)."}, se),
		paramsMissing: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "loxilb_ai_pd_kv_params_missing_total",
			Help: "Successful prefill responses without transfer parameters; the request failed with 502."}, se),
		paramsBad: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "loxilb_ai_pd_kv_params_malformed_total",
			Help: "Prefill responses whose transfer parameters were malformed or over the size cap; the request failed with 502."}, se),
		legErrors: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "loxilb_ai_pd_leg_errors_total",
			Help: "Failed legs by leg (prefill, decode) and class (connect, tls, timeout, protocol, status)."},
			[]string{"service", "ep_idx", "leg", "class"}),
		legTimeouts: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "loxilb_pd_leg_timeouts_total",
			Help: "Legs that exceeded their timeout (prefill: whole leg; decode: first byte or idle)."},
			[]string{"service", "ep_idx", "leg"}),
		queued: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "loxilb_pd_admission_queued_total",
			Help: "Legs that waited for an endpoint slot because it was at LLB_PD_MAX_INFLIGHT_PER_EP."}, se),
		shed: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "loxilb_pd_admission_shed_total",
			Help: "Requests refused by admission: queue_full (429), park_timeout (503), total_cap (429)."},
			[]string{"service", "ep_idx", "reason"}),
		failover: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "loxilb_pd_connect_failover_total",
			Help: "Prefill legs moved to the next prefill endpoint because connecting to this one failed."}, se),
		streamAborted: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "loxilb_pd_decode_stream_aborted_total",
			Help: "Decode responses cut after bytes reached the client (upstream error, stall or the other leg failing)."}, se),
		earlyExit: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "loxilb_pd_trt_ctx_early_exit_total",
			Help: "TensorRT-LLM requests completed by their context leg (finish_reason not length/not_finished)."}, []string{"service"}),
		prefillTier: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "loxilb_pd_prefill_tier_total",
			Help: "Prefill choices by ladder tier (session, prefix, tier1.5, least_loaded)."}, []string{"service", "tier"}),
		sessionHits: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "loxilb_ai_pd_session_hits_total",
			Help: "Requests routed by P/D session affinity."}, []string{"service"}),
		sessionsActive: prometheus.NewGauge(prometheus.GaugeOpts{Name: "loxilb_pd_sessions_active",
			Help: "Sessions held in the P/D affinity table."}),
		trieKeys: prometheus.NewGauge(prometheus.GaugeOpts{Name: "loxilb_pd_trie_nodes",
			Help: "Block keys held in the P/D routing-history prefix index, all services."}),
		inflight: prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "loxilb_pd_inflight",
			Help: "Legs in flight per endpoint (admitted, not waiting)."}, se),
	}
	if reg != nil {
		for _, c := range []prometheus.Collector{m.requests, m.prefillDur, m.decodeTTFT, m.paramsFound, m.paramsMissing,
			m.paramsBad, m.legErrors, m.legTimeouts, m.queued, m.shed, m.failover, m.streamAborted, m.earlyExit,
			m.prefillTier, m.sessionHits, m.sessionsActive, m.trieKeys, m.inflight} {
			if err := reg.Register(c); err != nil {
				return nil, err
			}
		}
	}
	return m, nil
}
