package bench

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"time"

	"github.com/loxilb-llm/loxilb/pkg/router"
	"github.com/loxilb-llm/loxilb/pkg/tokenizer"
	"github.com/loxilb-llm/loxilb/testbed/enginesim"
)

// Model is the served model of the benchmark rule; its tokenizer must be
// staged in the tokenizer directory (testdata/tokenizers holds it).
const Model = "Qwen/Qwen3-0.6B"

// FleetConfig sizes the emulated fleet and its cost model.
type FleetConfig struct {
	// Engine is the emulated engine kind, vllm (default) or sglang.
	Engine  string `json:"engine,omitempty"`
	Engines int    `json:"engines"`
	// DPRanks is the data-parallel ranks per engine (default 1); each has
	// its own CapacityBlocks cache and event publisher, the engine's
	// MaxRunning is shared by them, and the rule names the count
	// (kvDpRankCount) so the gateway targets ranks.
	DPRanks           int     `json:"dp_ranks,omitempty"`
	BlockSize         int     `json:"block_size"`
	CapacityBlocks    int     `json:"capacity_blocks_per_engine"`
	PrefillUsPerToken float64 `json:"prefill_us_per_uncached_token"`
	DecodeUsPerToken  float64 `json:"decode_us_per_step"`
	MaxRunning        int     `json:"max_running_per_engine"`
	TimeScale         float64 `json:"time_scale"`
	HashSeed          string  `json:"hash_seed"`
	// Net is the third octet of the loopback addresses: engines listen on
	// 127.0.Net.11.., the VIP is 127.0.Net.1.
	Net     int `json:"loopback_net"`
	Port    int `json:"engine_port"`
	ZMQPort int `json:"kv_zmq_port"`
	VIPPort int `json:"vip_port"`
}

// TotalBlocks is the fleet's KV capacity in blocks.
func (f FleetConfig) TotalBlocks() int { return f.Engines * f.ranks() * f.CapacityBlocks }

func (f FleetConfig) ranks() int { return max(f.DPRanks, 1) }

func (f FleetConfig) engine() string {
	if f.Engine == "" {
		return enginesim.EngineVLLM
	}
	return f.Engine
}

// Describe names the fleet's engines for tables and charts.
func (f FleetConfig) Describe() string {
	name := map[string]string{enginesim.EngineVLLM: "vLLM", enginesim.EngineSGLang: "SGLang"}[f.engine()]
	if name == "" {
		name = f.engine()
	}
	if f.ranks() > 1 {
		return fmt.Sprintf("%d %s emulators x %d DP ranks x %d blocks", f.Engines, name, f.ranks(), f.CapacityBlocks)
	}
	return fmt.Sprintf("%d %s emulators x %d blocks", f.Engines, name, f.CapacityBlocks)
}

func (f FleetConfig) host(i int) string { return fmt.Sprintf("127.0.%d.%d", f.Net, 11+i) }
func (f FleetConfig) vipHost() string   { return fmt.Sprintf("127.0.%d.1", f.Net) }
func (f FleetConfig) vip() string       { return fmt.Sprintf("%s:%d", f.vipHost(), f.VIPPort) }

// Arm is one routing configuration under test.
type Arm struct {
	Name        string   `json:"name"`
	Label       string   `json:"label"`
	Select      string   `json:"select"` // loxicmd --select name
	Sel         int      `json:"sel"`    // the same as the rule's sel number
	KVExactMode int      `json:"kv_exact_mode"`
	Env         []string `json:"env,omitempty"` // daemon environment
	// Rule holds extra serviceArguments fields, as JSON members
	// ("chwbl_mean_load_factor":125); rules created through the API only.
	Rule string `json:"rule,omitempty"`
	// Nodes is how many gateway nodes serve the VIP (0 or 1: one daemon
	// with its embedded store). Several share an etcd store (Debian's
	// etcd-server) and the rule, and each binds the VIP with
	// SO_REUSEPORT, so the kernel hashes every client connection onto
	// one of them by its 4-tuple, as an ECMP route does per flow.
	Nodes int `json:"nodes,omitempty"`
}

// OnNodes returns the arm served by n gateway nodes, named arm@Nn.
func (a Arm) OnNodes(n int) Arm {
	a.Nodes = n
	a.Name = fmt.Sprintf("%s@%dn", a.Name, n)
	a.Label = fmt.Sprintf("%s, %d gateway nodes", a.Label, n)
	return a
}

// Arms compared by the default suite.
var (
	ArmRR    = Arm{Name: "rr", Label: "round robin", Select: "rr", Sel: 0}
	ArmCHWBL = Arm{Name: "chwbl", Label: "chwbl (consistent hash, bounded load)", Select: "chwbl", Sel: 8}
	// ArmKV is KV-exact with the product's defaults and no tuning
	// variable: spill relief on (kvExactMode 3) and the prefill queue
	// sized per endpoint by the budget the gateway learns from the engine.
	ArmKV = Arm{Name: "kv", Label: "KV-exact, product defaults", Select: "rr", Sel: 0, KVExactMode: 3}
	// ArmKVFCFS is KV-exact without the gateway's prefill queue: every
	// request is forwarded at once and waits in the engine's own
	// first-come-first-served queue.
	ArmKVFCFS = Arm{Name: "kv-fcfs", Label: "KV-exact, no prefill queue", Select: "rr", Sel: 0, KVExactMode: 3, Env: []string{"LOXILB_KV_SPILL_RELIEF=on", "LOXILB_KV_PREFILL_SLOTS=0"}}
	// ArmKVSlots2 is the kv arm with the prefill budget set by hand to
	// the default fleet's two running sequences, as an operator who knows
	// it would: it measures what learning the budget costs.
	ArmKVSlots2 = Arm{Name: "kv-slots2", Label: "KV-exact, prefill budget fixed at 2", Select: "rr", Sel: 0, KVExactMode: 3, Env: []string{"LOXILB_KV_PREFILL_SLOTS=2"}}
	// ArmKVNoTie is the kv arm without the cross-node tie-break: on
	// several nodes (-nodes) it measures what the tie-break adds against
	// the kv arm in the same run; on one node it is the kv arm.
	ArmKVNoTie = Arm{Name: "kv-notie", Label: "KV-exact, no cross-node tie-break", Select: "rr", Sel: 0, KVExactMode: 3, Env: []string{"LOXILB_KV_CLUSTER_TIEBREAK_MS=0"}}
	ArmKVNoSpl = Arm{Name: "kv-nospill", Label: "KV-exact, spill relief off", Select: "rr", Sel: 0, KVExactMode: 3, Env: []string{"LOXILB_KV_SPILL_RELIEF=off"}}
	// ArmKVLoad is KV-exact with the load blend weighted 16x the default
	// (one request in flight is worth 512 cached tokens instead of 32): it
	// shows how much of the gap to the targets the default blend leaves.
	// ArmCHWBLSystem is chwbl keyed as loxilb's binary does by default
	// (chwbl_prefix_hash_level 1, system prompt + model): the bounded load
	// alone spreads a service whose requests share a system prompt.
	ArmCHWBLSystem = Arm{Name: "chwbl-l1", Label: "chwbl, prefix hash level 1 (system prompt)", Select: "chwbl", Sel: 8, Rule: `"chwbl_prefix_hash_level":1`}
	// ArmCHWBL125 is chwbl with loxilb's schema default load factor, 125.
	ArmCHWBL125 = Arm{Name: "chwbl-125", Label: "chwbl, mean load factor 125", Select: "chwbl", Sel: 8, Rule: `"chwbl_mean_load_factor":125`}
	ArmKVLoad   = Arm{Name: "kv-load512", Label: "KV-exact, spill on, load penalty 512", Select: "rr", Sel: 0, KVExactMode: 3,
		Env: []string{"LOXILB_KV_SPILL_RELIEF=on", "LOXILB_KV_LOAD_PENALTY=512"}}
)

// DefaultArms returns the arms of the default suite in report order.
func DefaultArms() []Arm { return []Arm{ArmRR, ArmCHWBL, ArmKV, ArmKVNoSpl} }

// AllArms adds the arms a run can select by name (llmbench -arms).
func AllArms() []Arm {
	return append(DefaultArms(), ArmKVLoad, ArmKVFCFS, ArmKVSlots2, ArmKVNoTie, ArmCHWBLSystem, ArmCHWBL125)
}

// Suite is one benchmark run.
type Suite struct {
	Name      string      `json:"name"`
	Seed      uint64      `json:"seed"`
	Fleet     FleetConfig `json:"fleet"`
	Workloads []Workload  `json:"-"`
	Arms      []Arm       `json:"arms"`
	// Runs repeats every arm; the report gives the median of each metric.
	// 0 means 1.
	Runs int `json:"runs"`
}

func (s Suite) runs() int { return max(s.Runs, 1) }

// Options are the run's collaborators.
type Options struct {
	Bin          Binaries
	TokenizerDir string // holds <slug>/tokenizer.json for Model
	// UseLoxicmd creates rules with the loxicmd binary instead of the REST
	// API directly (the demo does, to show the user-facing path).
	UseLoxicmd bool
	Progress   io.Writer // progress bar; nil for none
	// Receipts, when set, gets one line per request: workload, arm,
	// prefix group, prompt tokens, TTFT and the routing receipt.
	Receipts io.Writer
	// Commands, when set, gets every loxicmd command line run.
	Commands io.Writer
	// RestartAfterSubscribe empties the engines' caches after the arm's
	// daemon has subscribed and replayed their event buffers, instead of
	// before it starts: the engine-restart-after-replay case of the event
	// path, which must leave the inventory as correct as a clean start.
	RestartAfterSubscribe bool
	Logger                *slog.Logger
}

// Run executes every workload under every arm and returns the report.
func Run(ctx context.Context, s Suite, o Options) (*Report, error) {
	if o.Logger == nil {
		o.Logger = slog.New(slog.DiscardHandler)
	}
	f := s.Fleet
	tok, err := tokenizer.Load(filepath.Join(o.TokenizerDir, tokenizer.Slug(Model)))
	if err != nil {
		return nil, fmt.Errorf("model tokenizer: %w", err)
	}
	for i := range s.Workloads {
		if err := tokenizeChat(&s.Workloads[i], tok, f.engine()); err != nil {
			return nil, err
		}
	}
	fl, err := startFleet(ctx, f, tok)
	if err != nil {
		return nil, err
	}
	defer fl.close()
	rep := &Report{Suite: s, Machine: DescribeMachine(), Started: time.Now().UTC()}
	total := 0
	for _, w := range s.Workloads {
		total += w.Requests() * len(s.Arms) * s.runs()
	}
	pb := newProgress(o.Progress, total)
	defer pb.finish()
	for _, w := range s.Workloads {
		wr := WorkloadResult{Workload: w, Requests: w.Requests(),
			Bound: UpperBound(w.Trace(), f)}
		runs := make([][]ArmResult, len(s.Arms))
		for r := 0; r < s.runs(); r++ {
			// Arms alternate within a repetition so that a noisy moment of
			// a shared machine hits one run of each arm, not one arm.
			for ai, arm := range s.Arms {
				pb.label(fmt.Sprintf("%s/%s #%d", w.Name, arm.Name, r+1))
				ar, err := runArm(ctx, s, o, fl, w, arm, pb)
				if err != nil {
					return rep, fmt.Errorf("workload %s, arm %s: %w", w.Name, arm.Name, err)
				}
				runs[ai] = append(runs[ai], ar)
			}
		}
		for ai := range s.Arms {
			ar := medianRun(runs[ai])
			if wr.Bound.FleetLRU > 0 {
				ar.OfBound = ar.HitRatio / wr.Bound.FleetLRU
			}
			wr.Arms = append(wr.Arms, ar)
		}
		rep.Workloads = append(rep.Workloads, wr)
	}
	rep.Elapsed = time.Since(rep.Started).Round(time.Millisecond).String()
	rep.Targets = CheckTargets(rep)
	return rep, nil
}

// fleet is the in-process engines of a run.
type fleet struct {
	cfg     FleetConfig
	engines []*enginesim.Engine
	cancel  context.CancelFunc
	wg      sync.WaitGroup
}

// startFleet starts the engines with the model's real tokenizer, so a
// chat request renders and tokenizes in the engine exactly as in the
// gateway.
func startFleet(ctx context.Context, f FleetConfig, tok *tokenizer.Tokenizer) (*fleet, error) {
	ctx, cancel := context.WithCancel(ctx)
	fl := &fleet{cfg: f, cancel: cancel}
	for i := 0; i < f.Engines; i++ {
		c := enginesim.Config{Engine: f.engine(), DPRanks: f.ranks(), Model: Model,
			Listen: fmt.Sprintf("%s:%d", f.host(i), f.Port), ZMQBind: f.host(i), ZMQPort: f.ZMQPort,
			BlockSize: f.BlockSize, CapacityBlocks: f.CapacityBlocks, Seed: f.HashSeed,
			PrefillUsPerToken: f.PrefillUsPerToken, DecodeUsPerToken: f.DecodeUsPerToken,
			MaxRunning: f.MaxRunning, TimeScale: f.TimeScale, TimeScaleSet: true}
		e, err := enginesim.New(c, enginesim.Deps{Tokenizer: enginesim.ModelTokenizer(tok)})
		if err != nil {
			fl.close()
			return nil, fmt.Errorf("engine %d on %s: %w", i, c.Listen, err)
		}
		fl.engines = append(fl.engines, e)
		fl.wg.Add(1)
		go func() { defer fl.wg.Done(); _ = e.Run(ctx) }()
	}
	return fl, nil
}

func (fl *fleet) close() {
	fl.cancel()
	fl.wg.Wait()
	for _, e := range fl.engines {
		_ = e.Close()
	}
}

func (fl *fleet) stats() []enginesim.Stats {
	out := make([]enginesim.Stats, len(fl.engines))
	for i, e := range fl.engines {
		out[i] = e.Stats()
	}
	return out
}

// createRule installs the arm's mode-4 rule, through loxicmd or the API.
func createRule(ctx context.Context, o Options, d *daemon, f FleetConfig, arm Arm) error {
	if o.UseLoxicmd && arm.Rule != "" {
		return fmt.Errorf("arm %s sets rule fields loxicmd has no flags for: create it through the API", arm.Name)
	}
	if o.UseLoxicmd {
		var eps []string
		for i := 0; i < f.Engines; i++ {
			eps = append(eps, f.host(i)+":1")
		}
		args := []string{"-p", fmt.Sprint(d.port), "create", "lb", f.vipHost(),
			fmt.Sprintf("--tcp=%d:%d", f.VIPPort, f.Port), "--endpoints=" + strings.Join(eps, ","),
			"--mode=fullproxy", "--select=" + arm.Select, "--model-name=" + Model}
		if arm.KVExactMode != 0 {
			args = append(args, fmt.Sprintf("--kv-exact-mode=%d", arm.KVExactMode), "--kv-engine-type="+f.engine(),
				fmt.Sprintf("--kv-dp-ranks=%d", f.ranks()),
				fmt.Sprintf("--kv-zmq-port=%d", f.ZMQPort), fmt.Sprintf("--kv-block-size=%d", f.BlockSize))
		}
		if o.Commands != nil {
			fmt.Fprintf(o.Commands, "$ loxicmd %s\n", strings.Join(args, " "))
		}
		cmd := exec.CommandContext(ctx, o.Bin.Loxicmd, args...)
		if out, err := cmd.CombinedOutput(); err != nil {
			return fmt.Errorf("loxicmd %s: %w\n%s", strings.Join(args, " "), err, out)
		}
		return nil
	}
	var eps []string
	for i := 0; i < f.Engines; i++ {
		eps = append(eps, fmt.Sprintf(`{"endpointIP":%q,"targetPort":%d,"weight":1}`, f.host(i), f.Port))
	}
	kv := ""
	if arm.KVExactMode != 0 {
		kv = fmt.Sprintf(`,"kvExactMode":%d,"kvEngineType":%q,"kvDpRankCount":%d,"kvZmqPort":%d,"kvBlockSize":%d`,
			arm.KVExactMode, f.engine(), f.ranks(), f.ZMQPort, f.BlockSize)
	}
	if arm.Rule != "" {
		kv += "," + arm.Rule
	}
	body := fmt.Sprintf(`{"serviceArguments":{"externalIP":%q,"port":%d,"protocol":"tcp","mode":4,"sel":%d,"model_name":%q%s},"endpoints":[%s]}`,
		f.vipHost(), f.VIPPort, arm.Sel, Model, kv, strings.Join(eps, ","))
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, d.url("/config/loadbalancer"), strings.NewReader(body))
	if err != nil {
		return err
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return fmt.Errorf("create rule: %w", err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != 200 {
		return fmt.Errorf("create rule: %d %s", resp.StatusCode, b)
	}
	return nil
}

// waitReady waits until the VIP answers and, for KV arms, every engine's
// event feed is subscribed.
func waitReady(ctx context.Context, d *daemon, f FleetConfig, arm Arm) error {
	deadline := time.Now().Add(20 * time.Second)
	for time.Now().Before(deadline) {
		ok := true
		if arm.KVExactMode != 0 {
			v, err := d.metric("loxilb_kv_subscriber_connected")
			ok = err == nil && int(v) == f.Engines // one gauge per endpoint, all its ranks
		}
		if ok {
			resp, err := http.Get("http://" + f.vip() + "/v1/models")
			if err == nil {
				resp.Body.Close()
				if resp.StatusCode == 200 {
					return nil
				}
			}
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(50 * time.Millisecond):
		}
	}
	return fmt.Errorf("rule not ready in 20s (VIP %s, event subscribers)\n%s", f.vip(), d.Logs())
}

// sample is one request's outcome at the client.
type sample struct {
	group   int
	ttft    time.Duration
	e2e     time.Duration
	err     string
	receipt router.Receipt
	hasRcpt bool
	out     int
	tokens  int
	turn    int
}

func runArm(ctx context.Context, s Suite, o Options, fl *fleet, w Workload, arm Arm, pb *progress) (ArmResult, error) {
	f := s.Fleet
	// Every arm starts cold: the engines drop their caches, by default
	// before the arm's daemon subscribes, so it sees the new epoch from
	// its start.
	restart := func() {
		for _, e := range fl.engines {
			e.Restart()
		}
	}
	if !o.RestartAfterSubscribe {
		restart()
	}
	state, err := os.MkdirTemp("", "llmbench-state")
	if err != nil {
		return ArmResult{}, err
	}
	defer os.RemoveAll(state)
	env := append([]string{"LLB_KV_NONE_HASH_SEED=" + f.HashSeed}, arm.Env...)
	nodes, err := startNodes(ctx, o, state, arm, env)
	if err != nil {
		return ArmResult{}, err
	}
	defer nodes.stop()
	d := nodes.d[0]
	if err := createRule(ctx, o, d, f, arm); err != nil {
		return ArmResult{}, err
	}
	for _, n := range nodes.d {
		if err := waitReady(ctx, n, f, arm); err != nil {
			return ArmResult{}, err
		}
	}
	if o.RestartAfterSubscribe {
		restart()
	}
	client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 512, MaxConnsPerHost: 0,
		DisableCompression: true}, Timeout: 120 * time.Second}
	defer client.CloseIdleConnections()
	// A request shorter than a block loads the model's tokenizer in the
	// gateway (a one-time start-up cost, not routing) and caches nothing;
	// counters are deltas from after it. Every node gets one: each is sent
	// on a new connection until every node has served one.
	if err := nodes.warmUp(ctx, f); err != nil {
		return ArmResult{}, err
	}
	nodesBefore := nodes.requests()
	before := fl.stats()

	var mu sync.Mutex
	var samples []sample
	record := func(sm sample) {
		mu.Lock()
		samples = append(samples, sm)
		if o.Receipts != nil {
			rc := "none"
			if sm.hasRcpt {
				rc = sm.receipt.String()
			}
			fmt.Fprintf(o.Receipts, "%s\t%s\tgroup=%d\tturn=%d\ttokens=%d\tttft_ms=%.1f\t%s\t%s\n", w.Name, arm.Name, sm.group, sm.turn, sm.tokens, ms(sm.ttft), rc, sm.err)
		}
		mu.Unlock()
		pb.add(1)
	}
	var wg sync.WaitGroup
	start := time.Now()
	for _, st := range w.Streams {
		if d := time.Until(start.Add(st.Start)); d > 0 {
			select {
			case <-ctx.Done():
				wg.Wait()
				return ArmResult{}, ctx.Err()
			case <-time.After(d):
			}
		}
		if st.Offsets != nil {
			for k, r := range st.Reqs {
				wg.Add(1)
				go func(k int, r Req) {
					defer wg.Done()
					select {
					case <-ctx.Done():
						return
					case <-time.After(time.Until(start.Add(st.at(k)))):
					}
					record(doRequest(ctx, client, f.vip(), r))
				}(k, r)
			}
			continue
		}
		wg.Add(1)
		go func(st Stream) {
			defer wg.Done()
			for k, r := range st.Reqs {
				if k > 0 && st.Think > 0 {
					select {
					case <-ctx.Done():
						return
					case <-time.After(st.Think):
					}
				}
				record(doRequest(ctx, client, f.vip(), r))
			}
		}(st)
	}
	wg.Wait()
	wall := time.Since(start)
	after := fl.stats()
	spills := 0.0
	for _, n := range nodes.d {
		v, _ := n.metric("loxilb_pd_kv_tier15_spills_total")
		spills += v
	}
	ar := summarize(arm, samples, before, after, wall, spills)
	if len(nodes.d) > 1 {
		for i, v := range nodes.requests() {
			ar.PerNode = append(ar.PerNode, v-nodesBefore[i])
		}
		for _, n := range nodes.d {
			v, _ := n.metric("loxilb_cluster_prefill_duplicate_leaders_total")
			ar.DuplicateLeaders += int(v)
			v, _ = n.metricWith("loxilb_cluster_prefill_tiebreak_total", `outcome="yielded"`)
			ar.TieYielded += int(v)
			v, _ = n.metric("loxilb_cluster_load_received_total")
			ar.LoadSnapshots += int(v)
		}
	}
	if arm.KVExactMode != 0 {
		if ar.PrefillBudgets, ar.PrefillQueued, err = d.prefillBudgets(f.Engines); err != nil {
			return ArmResult{}, fmt.Errorf("prefill budgets: %w", err)
		}
	}
	if !w.HasTurns() {
		ar.TTFTLaterTurnsMs = nil
	}
	return ar, nil
}

// nodes are an arm's gateway daemons (and the etcd they share when there
// are several).
type nodes struct {
	d    []*daemon
	etcd *daemon
}

// startNodes starts arm.Nodes daemons (at least one) with their state
// under dir: one alone on its embedded store, several on a fresh etcd,
// each with its own node name.
func startNodes(ctx context.Context, o Options, dir string, arm Arm, env []string) (*nodes, error) {
	ns := &nodes{}
	if arm.Nodes <= 1 {
		d, err := startDaemon(ctx, o.Bin.Loxilb, dir, o.TokenizerDir, env)
		if err != nil {
			return nil, err
		}
		ns.d = []*daemon{d}
		return ns, nil
	}
	etcdDir := filepath.Join(dir, "etcd")
	e, err := startEtcd(ctx, etcdDir)
	if err != nil {
		return nil, err
	}
	ns.etcd = e
	for k := 0; k < arm.Nodes; k++ {
		state := filepath.Join(dir, fmt.Sprintf("node%d", k+1))
		if err := os.MkdirAll(state, 0o700); err != nil {
			ns.stop()
			return nil, err
		}
		d, err := startDaemon(ctx, o.Bin.Loxilb, state, o.TokenizerDir, env,
			"--store", fmt.Sprintf("etcd://127.0.0.1:%d", e.port), "--node-name", fmt.Sprintf("bench-%d", k+1))
		if err != nil {
			ns.stop()
			return nil, fmt.Errorf("node %d: %w", k+1, err)
		}
		ns.d = append(ns.d, d)
	}
	return ns, nil
}

func (ns *nodes) stop() {
	var wg sync.WaitGroup
	for _, d := range ns.d {
		wg.Add(1)
		go func() { defer wg.Done(); d.stop() }()
	}
	wg.Wait()
	if ns.etcd != nil {
		ns.etcd.stop()
	}
}

// requests returns each node's count of proxied requests.
func (ns *nodes) requests() []int {
	out := make([]int, len(ns.d))
	for i, d := range ns.d {
		v, _ := d.metric("loxilb_ai_requests_total")
		out[i] = int(v)
	}
	return out
}

// warmUp sends sub-block requests, each on a new connection, until every
// node has served one (at most 40 per node).
func (ns *nodes) warmUp(ctx context.Context, f FleetConfig) error {
	for try := 0; try < 40*len(ns.d); try++ {
		c := &http.Client{Transport: &http.Transport{DisableKeepAlives: true}, Timeout: 60 * time.Second}
		sm := doRequest(ctx, c, f.vip(), Req{Tokens: []uint32{1000, 1001, 1002}, MaxTokens: 1, Group: -1})
		if sm.err != "" {
			return fmt.Errorf("warm-up request: %s", sm.err)
		}
		all := true
		for _, v := range ns.requests() {
			all = all && v > 0
		}
		if all {
			return nil
		}
	}
	return fmt.Errorf("warm-up: not every node served a request: %v", ns.requests())
}

// doRequest streams one completion (a chat completion when r.Chat is set)
// and times its first token.
func doRequest(ctx context.Context, c *http.Client, vip string, r Req) sample {
	sm := sample{group: r.Group, tokens: len(r.Tokens), turn: r.Turn}
	path := "/v1/completions"
	m := map[string]any{"model": Model, "prompt": r.Tokens, "max_tokens": r.MaxTokens, "stream": true}
	if r.Chat != nil {
		path = "/v1/chat/completions"
		m = map[string]any{"model": Model, "messages": r.Chat.Messages, "max_tokens": r.MaxTokens, "stream": true}
		if len(r.Chat.Tools) > 0 {
			m["tools"] = r.Chat.Tools
		}
	}
	body, _ := json.Marshal(m)
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, "http://"+vip+path, bytes.NewReader(body))
	if err != nil {
		sm.err = err.Error()
		return sm
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("X-Loxilb-Receipt", "1")
	t0 := time.Now()
	resp, err := c.Do(req)
	if err != nil {
		sm.err = err.Error()
		return sm
	}
	defer resp.Body.Close()
	if rc, err := router.ParseReceipt(resp.Header.Get("X-Loxilb-Route")); err == nil {
		sm.receipt, sm.hasRcpt = rc, true
	}
	if resp.StatusCode != 200 {
		b, _ := io.ReadAll(io.LimitReader(resp.Body, 512))
		sm.err = fmt.Sprintf("status %d: %s", resp.StatusCode, strings.TrimSpace(string(b)))
		return sm
	}
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if !strings.HasPrefix(line, "data: ") || line == "data: [DONE]" {
			continue
		}
		if sm.out == 0 {
			sm.ttft = time.Since(t0)
		}
		sm.out++
	}
	sm.e2e = time.Since(t0)
	if err := sc.Err(); err != nil {
		sm.err = "stream: " + err.Error()
	} else if sm.out == 0 {
		sm.err = "stream carried no chunk"
	}
	return sm
}

func percentile(sorted []time.Duration, p float64) time.Duration {
	if len(sorted) == 0 {
		return 0
	}
	i := int(p*float64(len(sorted)) + 0.5)
	if i >= len(sorted) {
		i = len(sorted) - 1
	}
	if i > 0 && p*float64(len(sorted)) <= float64(i) {
		i--
	}
	return sorted[i]
}

func ms(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }

func summarize(arm Arm, samples []sample, before, after []enginesim.Stats, wall time.Duration, spills float64) ArmResult {
	ar := ArmResult{Arm: arm.Name, Label: arm.Label, Requests: len(samples), WallSeconds: wall.Seconds(),
		Tiers: map[string]int{}, Spills: int(spills)}
	var ttfts, e2es, later []time.Duration
	groups := map[int]map[int]bool{}
	for _, s := range samples {
		if s.err != "" {
			ar.Errors++
			if ar.FirstError == "" {
				ar.FirstError = s.err
			}
			continue
		}
		ttfts = append(ttfts, s.ttft)
		e2es = append(e2es, s.e2e)
		if s.turn > 0 {
			later = append(later, s.ttft)
		}
		if s.hasRcpt {
			ar.Tiers[s.receipt.Tier]++
			if s.receipt.Matched == 0 {
				ar.Cold++
			}
			if s.group >= 0 && s.receipt.EP >= 0 {
				if groups[s.group] == nil {
					groups[s.group] = map[int]bool{}
				}
				groups[s.group][s.receipt.EP] = true
			}
		}
	}
	sort.Slice(ttfts, func(i, j int) bool { return ttfts[i] < ttfts[j] })
	sort.Slice(e2es, func(i, j int) bool { return e2es[i] < e2es[j] })
	ar.TTFTms = Percentiles{P50: ms(percentile(ttfts, .5)), P90: ms(percentile(ttfts, .9)), P99: ms(percentile(ttfts, .99))}
	ar.E2Ems = Percentiles{P50: ms(percentile(e2es, .5)), P90: ms(percentile(e2es, .9)), P99: ms(percentile(e2es, .99))}
	if len(ttfts) > 0 {
		var sum time.Duration
		for _, t := range ttfts {
			sum += t
		}
		ar.TTFTms.Mean = ms(sum / time.Duration(len(ttfts)))
	}
	if len(later) > 0 {
		p := percentiles(later)
		ar.TTFTLaterTurnsMs = &p
	}
	if len(groups) > 0 {
		n := 0
		for _, eps := range groups {
			n += len(eps)
		}
		ar.EndpointsPerGroup = float64(n) / float64(len(groups))
	}
	var hit, prompt, out uint64
	var total uint64
	for i := range after {
		dr := after[i].Requests - before[i].Requests
		ar.PerEndpoint = append(ar.PerEndpoint, int(dr))
		total += dr
		hit += after[i].HitTokens - before[i].HitTokens
		prompt += after[i].PromptTokens - before[i].PromptTokens
		out += after[i].OutputTokens - before[i].OutputTokens
	}
	if prompt > 0 {
		ar.HitRatio = float64(hit) / float64(prompt)
	}
	ar.PromptTokens, ar.HitTokens = prompt, hit
	if wall > 0 {
		ar.ThroughputRPS = float64(len(ttfts)) / wall.Seconds()
		ar.OutputTokPerSec = float64(out) / wall.Seconds()
	}
	if total > 0 {
		mean := float64(total) / float64(len(after))
		maxv := 0
		for _, v := range ar.PerEndpoint {
			maxv = max(maxv, v)
		}
		ar.MaxOverMeanLoad = float64(maxv) / mean
	}
	return ar
}

// DefaultTokenizerDir is the tokenizers bundled with the repository.
func DefaultTokenizerDir(root string) string { return filepath.Join(root, "testdata", "tokenizers") }
