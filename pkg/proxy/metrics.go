package proxy

import (
	"errors"
	"fmt"
	"strconv"
	"sync"

	"github.com/prometheus/client_golang/prometheus"
)

// metrics holds the proxy's collectors. Every series carries the service
// label (and ep where an endpoint is involved) so two rules never share a
// series.
type metrics struct {
	requests      *prometheus.CounterVec   // service, ep, status
	duration      *prometheus.HistogramVec // service
	activeStreams *prometheus.GaugeVec     // service
	upstreamErrs  *prometheus.CounterVec   // service, ep, class
	failover      *prometheus.CounterVec   // service
	bytes         *prometheus.CounterVec   // service, ep, direction
	connRejected  *prometheus.CounterVec   // reason
	upstreamLimit *prometheus.CounterVec   // service, ep, limit
	usageSeen     *prometheus.CounterVec   // service, ep, cached (yes|no)
	fallback      *prometheus.CounterVec   // reason
}

func newMetrics(reg prometheus.Registerer) (*metrics, error) {
	m := &metrics{
		requests: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "loxilb_ai_requests_total",
			Help: "Requests answered by the mode-4 proxy, by service, endpoint index (\"none\" if no endpoint was reached) and HTTP status (499 = client went away).",
		}, []string{"service", "ep_idx", "status"}),
		duration: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "loxilb_ai_request_duration_seconds",
			Help:    "Time from request arrival to the last response byte, by service.",
			Buckets: []float64{.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60, 120, 300},
		}, []string{"service"}),
		activeStreams: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "loxilb_ai_active_streams",
			Help: "Responses currently being relayed with per-write flushing (SSE or unknown length), by service.",
		}, []string{"service"}),
		upstreamErrs: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "loxilb_ai_upstream_errors_total",
			Help: "Failed attempts against an endpoint, by service, endpoint index and class (connect, tls, timeout, protocol, client_canceled).",
		}, []string{"service", "ep_idx", "class"}),
		failover: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "loxilb_proxy_connect_failover_total",
			Help: "Requests moved to the next candidate endpoint after a connect failure, by service.",
		}, []string{"service"}),
		bytes: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "loxilb_ai_bytes_total",
			Help: "Body bytes relayed, by service, endpoint index and direction (in = request, out = response).",
		}, []string{"service", "ep_idx", "direction"}),
		connRejected: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "loxilb_proxy_conn_rejected_total",
			Help: "Client connections or requests refused before routing, by reason (no_service: local address matches no rule; conn_limit: the listener holds MaxConnsPerListener connections, closed at accept; body_memory: request bodies in flight hold MaxInflightBodyBytes, answered 503; client_cert_missing, client_cert_invalid, client_cn_mismatch: a TLS handshake refused by the rule's client-certificate check; bad_request, framing, obs_fold, unsupported_te: a request head the lean HTTP/1.1 server refused, answered 400 (501 for unsupported_te) and closed).",
		}, []string{"reason"}),
		upstreamLimit: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "loxilb_proxy_upstream_limit_total",
			Help: "Endpoint responses cut by a proxy limit, by service, endpoint index and limit (response_header_bytes: 502; response_header_timeout: no headers or first body byte in time; stream_idle: no byte for StreamIdleTimeout mid-body; stream_duration: an event stream past its rule's max_stream_duration_sec).",
		}, []string{"service", "ep_idx", "limit"}),
		usageSeen: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "loxilb_ai_usage_reported_total",
			Help: "Responses whose usage block was extracted, by service, endpoint and whether cached_tokens was present.",
		}, []string{"service", "ep_idx", "cached"}),
		fallback: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "loxilb_proxy_http1_fallback_total",
			Help: "Client connections the lean HTTP/1.1 server handed to net/http's server, by reason (version: not HTTP/1.1; target: not a plain origin-form path; line_end: a bare LF or CR; expect: an expectation other than 100-continue; head_size: a head larger than the 4 KiB read buffer; header_fields: more than 256 fields; protocol: TLS negotiated another protocol).",
		}, []string{"reason"}),
	}
	if reg == nil {
		return m, nil
	}
	for _, c := range []prometheus.Collector{m.requests, m.duration, m.activeStreams, m.upstreamErrs, m.failover, m.bytes, m.connRejected, m.usageSeen, m.upstreamLimit, m.fallback} {
		if err := reg.Register(c); err != nil {
			var are prometheus.AlreadyRegisteredError
			if errors.As(err, &are) {
				return nil, fmt.Errorf("register proxy metrics: %w (one proxy per registry)", err)
			}
			return nil, fmt.Errorf("register proxy metrics: %w", err)
		}
	}
	return m, nil
}

// forget drops every series of a removed service so its numbers do not
// linger, and cannot be confused with a new rule reusing the ID later.
func (m *metrics) forget(service string) {
	l := prometheus.Labels{"service": service}
	m.requests.DeletePartialMatch(l)
	m.duration.DeletePartialMatch(l)
	m.activeStreams.DeletePartialMatch(l)
	m.upstreamErrs.DeletePartialMatch(l)
	m.failover.DeletePartialMatch(l)
	m.bytes.DeletePartialMatch(l)
	m.usageSeen.DeletePartialMatch(l)
	m.upstreamLimit.DeletePartialMatch(l)
}

// svcMetrics caches one service's series handles, so the request path
// does not hash label values on every request. It belongs to one
// configuration snapshot; Update builds a new one.
type svcMetrics struct {
	m        *metrics
	label    string
	duration prometheus.Observer
	streams  prometheus.Gauge
	failover prometheus.Counter
	eps      sync.Map // ep index -> *epMetrics
}

type epMetrics struct {
	label    string
	ok       prometheus.Counter // status 200, the common case
	bytesIn  prometheus.Counter
	bytesOut prometheus.Counter
	usage    [2]prometheus.Counter // cached_tokens absent, present
}

func (m *metrics) forService(label string) *svcMetrics {
	return &svcMetrics{
		m:        m,
		label:    label,
		duration: m.duration.WithLabelValues(label),
		streams:  m.activeStreams.WithLabelValues(label),
		failover: m.failover.WithLabelValues(label),
	}
}

func (sm *svcMetrics) ep(idx int) *epMetrics {
	if v, ok := sm.eps.Load(idx); ok {
		return v.(*epMetrics)
	}
	l := strconv.Itoa(idx)
	em := &epMetrics{
		label:    l,
		ok:       sm.m.requests.WithLabelValues(sm.label, l, "200"),
		bytesIn:  sm.m.bytes.WithLabelValues(sm.label, l, "in"),
		bytesOut: sm.m.bytes.WithLabelValues(sm.label, l, "out"),
		usage: [2]prometheus.Counter{
			sm.m.usageSeen.WithLabelValues(sm.label, l, "no"),
			sm.m.usageSeen.WithLabelValues(sm.label, l, "yes"),
		},
	}
	v, _ := sm.eps.LoadOrStore(idx, em)
	return v.(*epMetrics)
}
