package ebpf

// CapabilityName is the capability entry the daemon reports for this data plane.
const CapabilityName = "ebpf_dataplane"

// counterNames maps enum lb_counter (bpf/consts.h) to the names used in
// Stats.Counters and the Prometheus "reason" label.
var counterNames = [...]string{
	lbLbCounterCNT_PASS_NOT_IPV4:       "pass_not_ipv4",
	lbLbCounterCNT_PASS_NOT_L4:         "pass_not_l4",
	lbLbCounterCNT_PASS_NO_SERVICE:     "pass_no_service",
	lbLbCounterCNT_CT_HIT_ORIG:         "ct_hit_orig",
	lbLbCounterCNT_CT_HIT_REPLY:        "ct_hit_reply",
	lbLbCounterCNT_NEW_FLOW:            "new_flow",
	lbLbCounterCNT_FWD_REDIRECT:        "fwd_redirect",
	lbLbCounterCNT_FWD_STACK:           "fwd_stack",
	lbLbCounterCNT_FLOW_REOPENED:       "flow_reopened",
	lbLbCounterCNT_DROP_MALFORMED:      "drop_malformed",
	lbLbCounterCNT_PASS_FRAGMENT:       "pass_fragment",
	lbLbCounterCNT_DROP_NOT_SYN:        "drop_not_syn",
	lbLbCounterCNT_DROP_NO_ENDPOINT:    "drop_no_endpoint",
	lbLbCounterCNT_DROP_CT_INSERT:      "drop_ct_insert",
	lbLbCounterCNT_DROP_SNAT_EXHAUSTED: "drop_snat_exhausted",
	lbLbCounterCNT_DROP_REWRITE:        "drop_rewrite",
	lbLbCounterCNT_DROP_NO_ROUTE:       "drop_no_route",
	lbLbCounterCNT_DROP_UNSUPPORTED:    "drop_unsupported",
	lbLbCounterCNT_PROXY_STEERED:       "proxy_steered",
	lbLbCounterCNT_PROXY_NO_LISTENER:   "proxy_no_listener",
	lbLbCounterCNT_PROXY_ASSIGN_FAILED: "proxy_assign_failed",
	lbLbCounterCNT_FLOW_STALE:          "flow_stale",
	lbLbCounterCNT_RST_SENT:            "rst_sent",
	lbLbCounterCNT_FIB_CACHED:          "fib_cached",
	lbLbCounterCNT_FIB_CACHED_REPLY:    "fib_cached_reply", // folded into fib_cached by Stats, never reported
}

// A compile-time check that every counter has a name.
var _ [0]struct{} = [len(counterNames) - int(lbLbCounterCNT_MAX)]struct{}{}

// Twins of bpf/consts.h.
const (
	maxEPs     = 64
	beActive   = 0x01
	ctXlateSrc = 0x01
	ctXlateDst = 0x02
	ctReply    = 0x04
	ctDSR      = 0x08
	ctLCHeld   = 0x10
	ctNew      = 0
	ctEst      = 1
	ctFin      = 2
	ctClosed   = 3
	ctSYNSecs  = 60
	ctFINSecs  = 10
	// EPOCH_SVC_SHIFT: the high half of an epoch is the service generation.
	epochSvcShift = 16
	// CT_TIME_SHIFT: conntrack times count units of 2^ctTimeShift ns.
	ctTimeShift = 20
	// FIB_TTL: lifetime of a cached FIB result, in conntrack time units.
	fibTTLUnits = 1000
	// One-arm SNAT ports (SNAT_LOCAL_PORT_MIN/SPAN).
	snatLocalPortMin = 61000
	snatLocalPortMax = 65535
)

// foldCachedHits turns the program's counters into the reported ones. A hit
// redirected with the FIB result cached in its conntrack entry bumps only
// fib_cached or fib_cached_reply (one per-CPU counter per packet, not a hit
// counter and a verdict counter): it is added back to its direction's hit
// counter and to fwd_redirect, and fib_cached reports both directions.
func foldCachedHits(c map[string]uint64) {
	orig := c[counterNames[lbLbCounterCNT_FIB_CACHED]]
	reply := c[counterNames[lbLbCounterCNT_FIB_CACHED_REPLY]]
	delete(c, counterNames[lbLbCounterCNT_FIB_CACHED_REPLY])
	c[counterNames[lbLbCounterCNT_CT_HIT_ORIG]] += orig
	c[counterNames[lbLbCounterCNT_CT_HIT_REPLY]] += reply
	c[counterNames[lbLbCounterCNT_FIB_CACHED]] = orig + reply
	c[counterNames[lbLbCounterCNT_FWD_REDIRECT]] += orig + reply
}
