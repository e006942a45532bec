// Package health probes a rule's endpoints and keeps their up/down state.
//
// In: the desired set of Targets (service, endpoint index, address, target
// port, the rule's monitor flag and probe settings), replaced wholesale by
// Set whenever rules change. Out: Healthy(service, ep) for the proxy, the
// router and selectors (unhealthy endpoints leave scoring and selection),
// and a stream of Change events (Subscribe) for the reconciler that marks
// endpoints inactive in the kernel maps.
//
// Probe types (the rule's `probetype`):
//
//	tcp    connect to the probe port; with `probereq` set, send it and, with
//	       `proberesp` set, require that substring in the reply.
//	http   GET http://ep:port<probereq> (default "/"); a 2xx status is up;
//	       with `proberesp` set the first 64 KiB of the body must contain
//	       it. Redirects are not followed (a 3xx is down): a health URL that
//	       redirects is a misconfiguration worth seeing.
//	https  as http over TLS. Certificates are NOT verified by default, like
//	       loxilb's prober: the probe judges liveness, and endpoints commonly
//	       present self-signed or IP-addressed certificates. Set
//	       Config.TLSConfig to verify.
//	ping   ICMP echo, through an unprivileged ping socket when
//	       net.ipv4.ping_group_range admits the process's group, else a raw
//	       socket (root or CAP_NET_RAW). If neither is possible every probe
//	       fails with reason "ping_unavailable" and the error says why.
//	none   not probed; the endpoint is always healthy.
//	udp, sctp are rejected with ErrUnsupportedProbe: inference endpoints
//	       speak HTTP over TCP, and an unanswered UDP datagram proves nothing.
//
// Timing. loxilb's `probeTimeout` is the probe period in seconds (default
// 60). Here Probe.Interval carries it, with a default of 10 s because 60 s
// times the default 2 retries keeps a dead inference server in rotation for
// two minutes. Each attempt is bounded by Config.Timeout (default 3 s);
// attempts on one target never overlap. `probeRetries` (default 2) consecutive
// failures take an endpoint down; one success brings it back. Targets start
// healthy and are probed immediately when added, so a new rule is usable at
// once and a dead endpoint leaves after Retries probes. A service/endpoint
// pair the prober does not know is reported healthy (not monitored), as in
// loxilb.
//
// Metrics: loxilb_endpoint_healthy{service,ep} (1 up, 0 down),
// loxilb_endpoint_probe_failures_total{service,ep,reason} with reason one
// of timeout, refused, reset, unreachable, status, body, tls,
// ping_unavailable, error; and loxilb_endpoint_state_changes_total{service,ep}.
// Series are deleted when a target is removed.
package health
