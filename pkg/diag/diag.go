package diag

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/loxilb-llm/loxilb/pkg/control"
	"github.com/loxilb-llm/loxilb/pkg/kvevents"
	"github.com/loxilb-llm/loxilb/pkg/lbrule"
	"github.com/loxilb-llm/loxilb/pkg/tokenizer"
)

// Results of one check.
const (
	Pass = "PASS"
	Warn = "WARN"
	Fail = "FAIL"
)

// Check names.
const (
	CheckZMQ       = "zmq_port"
	CheckReplay    = "replay_port"
	CheckEvents    = "events"
	CheckParity    = "parity"
	CheckBlockSize = "block_size"
	CheckSeed      = "seed"
	CheckTokenizer = "tokenizer"
	CheckTRTDrain  = "trt_drain"
	CheckNIXL      = "nixl_side_channel"
)

// Check is one line of the report.
type Check struct {
	Result    string `json:"result"`
	Check     string `json:"check"`
	ServiceID uint32 `json:"service_id"`
	EPIdx     int    `json:"ep_idx"`
	// Endpoint is what was probed or judged (host:port, or a rank's
	// tcp:// endpoint).
	Endpoint string `json:"endpoint"`
	Found    string `json:"found"`
	Fix      string `json:"fix,omitempty"`
}

// Sources is what the checks read. Rules is required; a nil source skips
// the checks that need it.
type Sources struct {
	Rules func() []control.Service
	// Events reports an endpoint's subscription state.
	Events func(service uint32, ep int) (kvevents.EndpointStatus, bool)
	// SeedFingerprint identifies LLB_KV_NONE_HASH_SEED without revealing
	// it (cluster.SeedFingerprint, as `loxicmd get cluster` shows it);
	// SeedProblem is why the seed cannot serve vLLM (nil when it can).
	SeedFingerprint string
	SeedProblem     *lbrule.RuleError
	// TokenizerDir is where tokenizers are staged (<dir>/<slug>/tokenizer.json).
	TokenizerDir string
	// SidePort reports the NIXL side-channel port a vLLM prefill endpoint
	// last put in its kv_transfer_params (ok false before any).
	SidePort func(service uint32, ep int) (port int, ok bool)
	// Client fetches engine info; nil means a client with Timeout.
	Client *http.Client
	// Timeout bounds each probe (default 1s).
	Timeout time.Duration
	// StaleAfter is the event age past which a connected feed is reported
	// as quiet (default 5m): an idle engine publishes nothing.
	StaleAfter time.Duration
	// Now is the clock (default time.Now).
	Now func() time.Time
}

// Run checks every KV-exact or vLLM P/D rule, or only service when only
// is true. The
// probes of different endpoints run concurrently; the result is ordered by
// service, endpoint, then check.
func (s Sources) Run(ctx context.Context, service uint32, only bool) []Check {
	if s.Timeout <= 0 {
		s.Timeout = time.Second
	}
	if s.StaleAfter <= 0 {
		s.StaleAfter = 5 * time.Minute
	}
	if s.Now == nil {
		s.Now = time.Now
	}
	if s.Client == nil {
		s.Client = &http.Client{Timeout: s.Timeout}
	}
	var jobs []func() []Check
	for _, svc := range s.Rules() {
		if only && svc.ID != service {
			continue
		}
		r := svc.Rule
		for _, i := range r.SubscribedEndpoints() {
			jobs = append(jobs, func() []Check { return s.endpoint(ctx, svc.ID, r, i) })
		}
		// The side channel matters to every vLLM P/D rule, KV-exact or not.
		for i, ep := range r.Endpoints {
			if r.Engine() == kvevents.EngineVLLM && r.Service.PDDisagg && ep.Role == lbrule.RolePrefill {
				jobs = append(jobs, func() []Check { return s.nixl(svc.ID, i, ep) })
			}
		}
	}
	return parallel(jobs, maxParallel)
}

// maxParallel bounds the endpoints probed at once.
const maxParallel = 16

// parallel runs fs, at most limit at a time, and concatenates their lines
// in the order of fs: a report's order does not depend on which probe
// answered first, and its duration is about one probe timeout, not their
// sum.
func parallel(fs []func() []Check, limit int) []Check {
	out := make([][]Check, len(fs))
	sem := make(chan struct{}, limit)
	var wg sync.WaitGroup
	for j, f := range fs {
		sem <- struct{}{}
		wg.Go(func() {
			defer func() { <-sem }()
			out[j] = f()
		})
	}
	wg.Wait()
	var all []Check
	for _, c := range out {
		all = append(all, c...)
	}
	return all
}

// Failed reports whether any check failed.
func Failed(cs []Check) bool {
	for _, c := range cs {
		if c.Result == Fail {
			return true
		}
	}
	return false
}

func (s Sources) endpoint(ctx context.Context, id uint32, r *lbrule.Rule, i int) []Check {
	ep := r.Endpoints[i]
	hp := net.JoinHostPort(ep.IP, strconv.Itoa(ep.Port))
	line := func(res, check, where, found, fix string) Check {
		return Check{Result: res, Check: check, ServiceID: id, EPIdx: i, Endpoint: where, Found: found, Fix: fix}
	}
	st, subscribed := kvevents.EndpointStatus{}, false
	if s.Events != nil {
		st, subscribed = s.Events(id, i)
	}
	eng := r.Engine()
	var probes []func() []Check
	probe := func(f func() Check) { probes = append(probes, func() []Check { return []Check{f()} }) }
	if eng == kvevents.EngineTRTLLM {
		probe(func() Check {
			return s.dial(line, CheckZMQ, hp, "the serving port (TensorRT-LLM events are drained over HTTP there)", "start the engine or correct endpointIP/targetPort")
		})
	} else {
		for rank := range max(r.Service.KVDpRankCount, 1) {
			zmq := net.JoinHostPort(ep.IP, strconv.Itoa(r.Service.KVZmqPort+rank))
			probe(func() Check {
				return s.dial(line, CheckZMQ, zmq, fmt.Sprintf("rank %d publisher", rank),
					fmt.Sprintf("start the engine's KV event publisher on %s (vLLM --kv-events-config endpoint, SGLang --kv-events-config with --dp-size ranks) or correct kvZmqPort/kvDpRankCount", zmq))
			})
			if subscribed && rank < len(st.Ranks) && st.Ranks[rank].ReplayEndpoint != "" {
				hostPort := strings.TrimPrefix(st.Ranks[rank].ReplayEndpoint, "tcp://")
				probe(func() Check {
					c := s.dial(line, CheckReplay, hostPort, fmt.Sprintf("rank %d replay", rank),
						"start the publisher's replay endpoint there (vLLM replay_endpoint) or set LLB_KV_REPLAY_PORT_OFFSET to where it is; without replay a lost event clears nothing until the next reset")
					if c.Result == Fail {
						c.Result = Warn // replay only repairs gaps
					}
					return c
				})
			}
		}
	}
	probes = append(probes, func() []Check { return s.events(line, hp, st, subscribed) })
	if eng != kvevents.EngineTRTLLM {
		probe(func() Check {
			return s.blockSize(ctx, line, eng, r.Service.Security == lbrule.SecurityE2ETLS, hp, r.Service.KVBlockSize)
		})
	}
	out := parallel(probes, 2*MaxRanksProbed+2)
	if eng == kvevents.EngineVLLM {
		out = append(out, s.seed(line, hp, st, subscribed))
	}
	out = append(out, s.tokenizer(line, hp, r.Service.ModelName))
	if eng == kvevents.EngineTRTLLM {
		out = append(out, trtDrain(line, hp, st, subscribed))
	}
	return out
}

// MaxRanksProbed is the most publisher ranks of one endpoint (each with a
// replay port) probed at once: the rule limit.
const MaxRanksProbed = kvevents.MaxRanks

type lineFunc func(res, check, where, found, fix string) Check

// dial is a TCP connect with the probe timeout: reachability only.
func (s Sources) dial(line lineFunc, check, hostPort, what, fix string) Check {
	d := net.Dialer{Timeout: s.Timeout}
	c, err := d.Dial("tcp", hostPort)
	if err != nil {
		return line(Fail, check, hostPort, what+" unreachable: "+err.Error(), fix)
	}
	c.Close()
	return line(Pass, check, hostPort, what+" accepts TCP connections", "")
}

func (s Sources) events(line lineFunc, hp string, st kvevents.EndpointStatus, ok bool) []Check {
	if !ok {
		return []Check{line(Fail, CheckEvents, hp, "no KV event subscription for this endpoint",
			"check the rule's status (loxicmd get lb) and the daemon log: the subscription was refused or the rule is not applied")}
	}
	var out []Check
	var last time.Time
	var batches uint64
	for _, r := range st.Ranks {
		batches += r.Batches
		if r.LastRecv.After(last) {
			last = r.LastRecv
		}
	}
	counters := fmt.Sprintf("%d batches, %d events applied, %d blocks stored, %d gaps, %d decode errors, %d rejected",
		batches, st.EventsApplied, st.BlocksStored, st.Gaps, st.DecodeErrors, st.Rejected)
	switch {
	case !st.Connected:
		why := st.LastError
		if why == "" {
			why = "not connected"
		}
		out = append(out, line(Fail, CheckEvents, hp, "subscriber not connected on every rank: "+why+"; "+counters,
			"make the publisher reachable from the gateway (see the zmq_port lines)"))
	case batches == 0:
		out = append(out, line(Warn, CheckEvents, hp, "connected, no event batch received yet; "+counters,
			"send a request through the gateway; if blocks still do not arrive, check the engine runs with prefix caching and KV events enabled"))
	case st.Degraded:
		out = append(out, line(Warn, CheckEvents, hp, "events lost and not replayed (inventory inexact until the next reset); "+counters,
			"make the replay endpoint reachable (see replay_port)"))
	case s.Now().Sub(last) > s.StaleAfter:
		out = append(out, line(Warn, CheckEvents, hp, fmt.Sprintf("last event %s ago; %s", s.Now().Sub(last).Round(time.Second), counters),
			"normal for an idle engine; otherwise check the publisher"))
	default:
		out = append(out, line(Pass, CheckEvents, hp, fmt.Sprintf("last event %s ago; %s", s.Now().Sub(last).Round(time.Millisecond), counters), ""))
	}
	p := st.Parity
	switch {
	case p.Quarantine.Quarantined:
		out = append(out, line(Fail, CheckParity, hp, "quarantined: "+p.Quarantine.Reason, "fix the hash contract (seed, kvHashAlgo, kvBlockSize, tokenizer); the endpoint leaves quarantine once blocks verify"))
	case p.Verdict == kvevents.VerdictOK:
		out = append(out, line(Pass, CheckParity, hp, fmt.Sprintf("attested: %d blocks verified, %d mismatched", p.VerifiedBlocks, p.MismatchedBlocks), ""))
	case p.Verdict == kvevents.VerdictUnverified || p.Verdict == "":
		out = append(out, line(Warn, CheckParity, hp, "unverified: no block attested yet ("+p.Reason+")", "send a prompt longer than one block through the gateway"))
	default:
		out = append(out, line(Fail, CheckParity, hp, p.Verdict+": "+p.Reason, "align the parity triad: seed (PYTHONHASHSEED = LLB_KV_NONE_HASH_SEED), kvHashAlgo, kvBlockSize"))
	}
	return out
}

func (s Sources) seed(line lineFunc, hp string, st kvevents.EndpointStatus, ok bool) Check {
	if s.SeedProblem != nil {
		return line(Fail, CheckSeed, hp, s.SeedProblem.Reason+": "+s.SeedProblem.Msg, "set LLB_KV_NONE_HASH_SEED to the engine's PYTHONHASHSEED and restart the daemon")
	}
	fp := s.SeedFingerprint
	if ok && st.Parity.Verdict == kvevents.VerdictHashMismatch {
		return line(Fail, CheckSeed, hp, "gateway seed fingerprint "+fp+" does not reproduce the engine's block hashes",
			"set the engine's PYTHONHASHSEED equal to LLB_KV_NONE_HASH_SEED (the fingerprint is the SEED column of `loxicmd get cluster`; a node started with the engine's seed shows the one to match)")
	}
	if ok && st.Parity.Verdict == kvevents.VerdictOK {
		return line(Pass, CheckSeed, hp, "gateway seed fingerprint "+fp+" reproduces the engine's block hashes", "")
	}
	return line(Warn, CheckSeed, hp, "gateway seed fingerprint "+fp+", not yet confirmed by an attested block",
		"send a prompt longer than one block through the gateway, then run diagnostics again")
}

func (s Sources) tokenizer(line lineFunc, hp, model string) Check {
	if model == "" {
		return line(Warn, CheckTokenizer, hp, "the rule pins no model_name: the tokenizer is chosen per request",
			"set model_name to the served model so its staged tokenizer can be checked")
	}
	if s.TokenizerDir == "" {
		return line(Warn, CheckTokenizer, hp, "no tokenizer directory configured", "set --tokenizer-dir")
	}
	p := filepath.Join(s.TokenizerDir, tokenizer.Slug(model), "tokenizer.json")
	fi, err := os.Stat(p)
	if err != nil || !fi.Mode().IsRegular() {
		return line(Fail, CheckTokenizer, hp, fmt.Sprintf("model %q: %s is not staged", model, p),
			"stage the served model's tokenizer.json at "+p)
	}
	return line(Pass, CheckTokenizer, hp, fmt.Sprintf("model %q staged at %s (%d bytes)", model, p, fi.Size()), "")
}

func trtDrain(line lineFunc, hp string, st kvevents.EndpointStatus, ok bool) Check {
	if ok && st.Drain != nil {
		// With several nodes, say who drains before judging admission:
		// a follower's admission is the owner's business.
		switch d := st.Drain; d.Role {
		case kvevents.DrainElecting:
			return line(Warn, CheckTRTDrain, hp, "no node owns the event drain yet (election pending, or the etcd store is unreachable)",
				"check the rule_store capability; a node takes the drain within --trt-drain-lease-ttl of reaching etcd")
		case kvevents.DrainFollower:
			if !st.Connected {
				return line(Warn, CheckTRTDrain, hp, "node "+d.Owner+" drains; this node's relay stream from it is down: "+st.LastError,
					"make the owner's management API reachable from this node (--advertise-addr, the shared API token)")
			}
			return line(Pass, CheckTRTDrain, hp, "node "+d.Owner+" drains; this node follows its relay stream", "")
		}
	}
	if !ok || st.Admission == nil {
		return line(Warn, CheckTRTDrain, hp, "drain ownership not known yet (no /server_info check)", "wait for the subscriber's admission check")
	}
	who := "the gateway owns the event drain "
	if st.Drain != nil && st.Drain.Role == kvevents.DrainOwner {
		who = fmt.Sprintf("this node owns the event drain (elected; %d nodes follow its relay) ", st.Drain.Followers)
	}
	a := st.Admission
	switch a.Verdict {
	case kvevents.AdmissionAdmitted, kvevents.AdmissionLegacy:
		return line(Pass, CheckTRTDrain, hp, a.Verdict+": "+who+a.Reason, "")
	case kvevents.AdmissionPending:
		return line(Warn, CheckTRTDrain, hp, "admission pending: "+a.Reason, "wait for the /server_info check, or make /server_info reachable")
	}
	return line(Fail, CheckTRTDrain, hp, "admission "+a.Verdict+": "+a.Reason,
		"the gateway must be the sole consumer of /kv_cache_events: stop other drainers and match the /server_info geometry")
}

func (s Sources) nixl(id uint32, i int, ep lbrule.Endpoint) []Check {
	hp := net.JoinHostPort(ep.IP, strconv.Itoa(ep.Port))
	line := func(res, found, fix string) []Check {
		return []Check{{Result: res, Check: CheckNIXL, ServiceID: id, EPIdx: i, Endpoint: hp, Found: found, Fix: fix}}
	}
	if ep.NixlPort != 0 {
		return line(Pass, fmt.Sprintf("nixl_port %d is handed to the decode leg", ep.NixlPort), "")
	}
	if s.SidePort == nil {
		return nil
	}
	rp, ok := s.SidePort(id, i)
	switch {
	case !ok:
		return line(Warn, "nixl_port 0: the decode leg is pointed at the HTTP port; no prefill response seen yet to compare with the engine's remote_port",
			"set nixl_port to the engine's VLLM_NIXL_SIDE_CHANNEL_PORT (5600 by default) unless it serves on the HTTP port")
	case rp != ep.Port:
		return line(Warn, fmt.Sprintf("nixl_port 0 replaces the engine's reported remote_port %d with the HTTP port %d", rp, ep.Port),
			fmt.Sprintf("set nixl_port %d on this endpoint", rp))
	}
	return line(Pass, fmt.Sprintf("nixl_port 0: the engine reports remote_port %d, its HTTP port", rp), "")
}
