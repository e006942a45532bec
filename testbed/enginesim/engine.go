package enginesim

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"net"
	"net/http"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// Deps are the injected collaborators of an Engine. All are optional.
type Deps struct {
	Logger    *slog.Logger
	Tokenizer Tokenizer        // default SimpleTokenizer
	Now       func() time.Time // event timestamps and "created"; default time.Now
	// HTTPClient is used by decode legs to reach their prefill engine.
	HTTPClient *http.Client
	// Sleep waits out a modelled delay (already time-scaled); default a
	// timer that also ends with ctx. Tests inject a recorder.
	Sleep func(ctx context.Context, d time.Duration) error
}

// rank is one data-parallel rank: its own cache and event publisher.
type rank struct {
	id    int
	mu    sync.Mutex // serialises cache mutations with their events
	cache *blockCache
	pub   *zmqPublisher // nil when ZMQ events are off

	// served counts requests this rank was given, targeted those that
	// named it.
	served, targeted atomic.Uint64
	// running and waiting are the rank's share of the scheduler's
	// requests, which SGLang publishes per data-parallel rank.
	running, waiting atomic.Int64
}

// Engine is one emulated inference engine: an HTTP server with the engine's
// API, a prefix cache per rank and a KV-event feed in the engine's format.
type Engine struct {
	cfg    Config
	log    *slog.Logger
	tok    Tokenizer
	now    func() time.Time
	client *http.Client
	sleepf func(ctx context.Context, d time.Duration) error
	hasher blockHasher
	loras  []*loraRef
	enc    zmqEncoder
	ranks  []*rank
	trt    *trtQueue
	faults *faultState
	sched  *scheduler
	pd     *pdStore
	reg    *prometheus.Registry

	ln, bootLn   net.Listener
	srv, bootSrv *http.Server
	// sideLn and sideSrv are the vLLM NIXL side channel (NIXLSidePort).
	sideLn        net.Listener
	sideSrv       *http.Server
	advertiseHost string
	engineID      string

	rr, reqSeq                               atomic.Uint64
	started                                  time.Time
	requests, failed, promptTok, hitTok      atomic.Uint64
	completed, outputTok, transfers, claimed atomic.Uint64
	ctxReqID                                 atomic.Uint64
	queries                                  atomic.Uint64
	activeBlocks                             atomic.Int64 // blocks pinned by running requests

	closeOnce sync.Once
}

// New builds an engine and binds all its sockets (HTTP, ZMQ PUB and replay,
// SGLang bootstrap), so the addresses are known when it returns. Serve with
// Run; release with Close.
func New(cfg Config, deps Deps) (*Engine, error) {
	cfg = cfg.Defaults()
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("engine config: %w", err)
	}
	e := &Engine{cfg: cfg, log: deps.Logger, tok: deps.Tokenizer, now: deps.Now, client: deps.HTTPClient,
		faults: &faultState{f: cfg.Faults}, sched: newScheduler(cfg.MaxRunning, cfg.MaxQueue)}
	if e.log == nil {
		e.log = slog.New(slog.DiscardHandler)
	}
	e.log = e.log.With("engine", cfg.Engine, "role", cfg.Role)
	if e.tok == nil {
		e.tok = SimpleTokenizer{}
	}
	if e.now == nil {
		e.now = time.Now
	}
	e.sleepf = deps.Sleep
	if e.sleepf == nil {
		e.sleepf = timerSleep
	}
	if e.client == nil {
		e.client = &http.Client{Timeout: cfg.PDTimeout + 10*time.Second}
	}
	hashEngine, algo := cfg.Engine, cfg.HashAlgo
	if cfg.Engine == EngineLlamaCpp {
		// llama.cpp publishes nothing; any stable key serves its cache.
		hashEngine, algo = EngineVLLM, AlgoSHA256CBOR
	}
	h, err := newHasher(hashEngine, algo, cfg.Seed, cfg.BlockSize)
	if err != nil {
		return nil, fmt.Errorf("engine config: %w", err)
	}
	e.hasher = h
	for i, name := range cfg.LoRAModules {
		e.loras = append(e.loras, &loraRef{name: name, id: i + 1})
	}
	e.enc = zmqEncoder{engine: cfg.Engine, encoding: cfg.EventEncoding, intHashes: !cfg.BytesBlockHashes}
	e.started = time.Now()
	e.engineID = fmt.Sprintf("sim-%s-%x", cfg.Engine, e.started.UnixNano())
	e.pd = newPDStore()

	ok := false
	defer func() {
		if !ok {
			e.Close()
		}
	}()
	e.ln, err = net.Listen("tcp", cfg.Listen)
	if err != nil {
		return nil, fmt.Errorf("listen %s: %w", cfg.Listen, err)
	}
	e.advertiseHost = cfg.AdvertiseHost
	if e.advertiseHost == "" {
		host, _, _ := net.SplitHostPort(e.ln.Addr().String())
		if ip := net.ParseIP(host); ip == nil || ip.IsUnspecified() {
			host = "127.0.0.1"
		}
		e.advertiseHost = host
	}
	perBlock := cfg.Engine == EngineSGLang
	zmqOn := (cfg.Engine == EngineVLLM || cfg.Engine == EngineSGLang) && cfg.ZMQPort >= 0
	for i := 0; i < cfg.DPRanks; i++ {
		r := &rank{id: i, cache: newBlockCache(cfg.CapacityBlocks, cfg.BlockSize, perBlock)}
		r.cache.cpuCap = cfg.CPUOffloadBlocks
		e.ranks = append(e.ranks, r)
		if !zmqOn {
			continue
		}
		pc := pubConfig{topic: cfg.Topic, replayWithTopic: cfg.ReplayFormat == ReplayTopic, bufferSteps: cfg.BufferSteps}
		pc.endpoint = zmqEndpoint(cfg.ZMQBind, cfg.ZMQPort, i)
		switch {
		case cfg.ReplayPort > 0:
			pc.replayEndpoint = zmqEndpoint(cfg.ZMQBind, cfg.ReplayPort, i)
		case cfg.ReplayPort == 0 && cfg.ZMQPort > 0:
			pc.replayEndpoint = zmqEndpoint(cfg.ZMQBind, cfg.ZMQPort+1000, i)
		case cfg.ReplayPort == 0:
			pc.replayEndpoint = zmqEndpoint(cfg.ZMQBind, 0, 0)
		}
		r.pub, err = newZMQPublisher(e.log.With("rank", i), pc, e.faults, cfg.RandSeed+uint64(i))
		if err != nil {
			return nil, err
		}
	}
	if cfg.Engine == EngineTRTLLM {
		e.trt = newTRTQueue(cfg.TRTEventBuffer, cfg.MaxModelLen, cfg.CapacityBlocks, cfg.DPRanks > 1, e.faults, cfg.RandSeed)
	}
	if cfg.Engine == EngineSGLang && cfg.Role == RolePrefill {
		addr := net.JoinHostPort(hostOf(cfg.Listen), strconv.Itoa(cfg.BootstrapPort))
		e.bootLn, err = net.Listen("tcp", addr)
		if err != nil {
			return nil, fmt.Errorf("bootstrap listen %s: %w", addr, err)
		}
		e.bootSrv = &http.Server{Handler: e.bootstrapHandler(), ReadHeaderTimeout: 10 * time.Second}
	}
	if cfg.Engine == EngineVLLM && cfg.Role != RoleDecode && cfg.NIXLSidePort != 0 {
		addr := net.JoinHostPort(hostOf(cfg.Listen), strconv.Itoa(max(cfg.NIXLSidePort, 0)))
		e.sideLn, err = net.Listen("tcp", addr)
		if err != nil {
			return nil, fmt.Errorf("NIXL side channel listen %s: %w", addr, err)
		}
		side := http.NewServeMux()
		side.HandleFunc("POST /sim/pd/claim/{id}", e.handleClaim)
		e.sideSrv = &http.Server{Handler: side, ReadHeaderTimeout: 10 * time.Second}
	}
	e.reg = prometheus.NewRegistry()
	if err := e.registerMetrics(e.reg); err != nil {
		return nil, fmt.Errorf("metrics: %w", err)
	}
	e.srv = &http.Server{Handler: e.Handler(), ReadHeaderTimeout: 10 * time.Second}
	ok = true
	return e, nil
}

func hostOf(hostport string) string {
	h, _, err := net.SplitHostPort(hostport)
	if err != nil {
		return hostport
	}
	return h
}

func zmqEndpoint(host string, base, rank int) string {
	port := 0
	if base > 0 {
		port = base + rank
	}
	return "tcp://" + net.JoinHostPort(host, strconv.Itoa(port))
}

// Run serves HTTP (and the bootstrap listener) until ctx ends, then shuts
// down and closes the engine.
func (e *Engine) Run(ctx context.Context) error {
	errc := make(chan error, 3)
	go func() { errc <- e.srv.Serve(e.ln) }()
	if e.bootSrv != nil {
		go func() { errc <- e.bootSrv.Serve(e.bootLn) }()
	}
	if e.sideSrv != nil {
		go func() { errc <- e.sideSrv.Serve(e.sideLn) }()
	}
	var err error
	select {
	case <-ctx.Done():
	case err = <-errc:
		if errors.Is(err, http.ErrServerClosed) {
			err = nil
		}
	}
	sctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	_ = e.srv.Shutdown(sctx)
	if e.bootSrv != nil {
		_ = e.bootSrv.Shutdown(sctx)
	}
	if e.sideSrv != nil {
		_ = e.sideSrv.Shutdown(sctx)
	}
	if cerr := e.Close(); err == nil {
		err = cerr
	}
	return err
}

// Close releases every socket. It is safe to call more than once.
func (e *Engine) Close() error {
	e.closeOnce.Do(func() {
		if e.srv != nil {
			_ = e.srv.Close()
		} else if e.ln != nil {
			_ = e.ln.Close()
		}
		if e.bootSrv != nil {
			_ = e.bootSrv.Close()
		} else if e.bootLn != nil {
			_ = e.bootLn.Close()
		}
		if e.sideSrv != nil {
			_ = e.sideSrv.Close()
		} else if e.sideLn != nil {
			_ = e.sideLn.Close()
		}
		for _, r := range e.ranks {
			if r.pub != nil {
				r.pub.close()
			}
		}
		e.pd.close()
	})
	return nil
}

// Addr is the HTTP host:port.
func (e *Engine) Addr() string { return e.ln.Addr().String() }

// URL is the HTTP base URL, e.g. http://127.0.0.1:41234.
func (e *Engine) URL() string { return "http://" + e.Addr() }

// Config is the engine's configuration with defaults applied.
func (e *Engine) Config() Config { return e.cfg }

// ZMQPorts lists the PUB port of each rank (empty without ZMQ events).
func (e *Engine) ZMQPorts() []int {
	var out []int
	for _, r := range e.ranks {
		if r.pub != nil {
			out = append(out, tcpPort(r.pub.pub.Addr()))
		}
	}
	return out
}

// ReplayPorts lists the ROUTER port of each rank (empty without replay).
func (e *Engine) ReplayPorts() []int {
	var out []int
	for _, r := range e.ranks {
		if r.pub != nil && r.pub.router != nil {
			out = append(out, tcpPort(r.pub.router.Addr()))
		}
	}
	return out
}

// BootstrapPort is the SGLang prefill bootstrap port (0 when not a prefill).
func (e *Engine) BootstrapPort() int {
	if e.bootLn == nil {
		return 0
	}
	return tcpPort(e.bootLn.Addr())
}

// NIXLSidePort is the vLLM NIXL side-channel port (NIXLSidePort), or 0
// when transfers are claimed on the HTTP port.
func (e *Engine) NIXLSidePort() int {
	if e.sideLn == nil {
		return 0
	}
	return tcpPort(e.sideLn.Addr())
}

func tcpPort(a net.Addr) int {
	if t, ok := a.(*net.TCPAddr); ok {
		return t.Port
	}
	_, p, err := net.SplitHostPort(a.String())
	if err != nil {
		return 0
	}
	n, _ := strconv.Atoi(p)
	return n
}

// emit publishes the events of one cache mutation as one batch. The caller
// holds r.mu so batches leave in mutation order.
func (e *Engine) emit(r *rank, evs []kvEvent) {
	if len(evs) == 0 {
		return
	}
	switch {
	case r.pub != nil:
		ts := float64(e.now().UnixNano()) / 1e9
		r.pub.enqueue(pubItem{payload: e.enc.batch(ts, evs, r.id)})
	case e.trt != nil:
		e.trt.push(evs, r.id)
	}
}

// Restart emulates an engine restart: every cache is cleared, ZMQ sequence
// numbers restart at 0 with an AllBlocksCleared batch, and the TensorRT-LLM
// queue restarts its event ids with a "created" event.
func (e *Engine) Restart() {
	for _, r := range e.ranks {
		r.mu.Lock()
		r.cache.clear()
		if r.pub != nil {
			r.pub.enqueue(pubItem{reset: true})
			e.emit(r, []kvEvent{{kind: evCleared}})
		}
		r.mu.Unlock()
	}
	if e.trt != nil {
		e.trt.restart()
	}
}

// SetFaults replaces the active faults.
func (e *Engine) SetFaults(f Faults) error {
	if err := f.validate(); err != nil {
		return err
	}
	e.faults.set(f)
	return nil
}

// Faults returns the active faults.
func (e *Engine) Faults() Faults { return e.faults.get() }

// RankStats is one rank's cache and publisher state.
type RankStats struct {
	Rank        int    `json:"rank"`
	BlocksUsed  int    `json:"blocks_used"`
	Evictions   uint64 `json:"evictions"`
	CPUBlocks   int    `json:"cpu_blocks"` // blocks in the CPU offload tier
	Uncacheable uint64 `json:"uncacheable_blocks"`
	NextSeq     uint64 `json:"next_seq"`
	Enqueued    uint64 `json:"batches_enqueued"`
	Published   uint64 `json:"batches_published"`
	Dropped     uint64 `json:"batches_dropped"`
	Reordered   uint64 `json:"batches_reordered"`
	Replays     uint64 `json:"replay_requests"`
	Lost        uint64 `json:"batches_lost_at_shutdown"`
	Subscribers int    `json:"subscribed_topics"`
	Served      uint64 `json:"requests_served"`
	Targeted    uint64 `json:"requests_targeted"`
}

// Stats is the body of GET /sim/stats. HitRatio is hit_tokens/prompt_tokens.
type Stats struct {
	Engine         string  `json:"engine"`
	Role           string  `json:"role"`
	Model          string  `json:"model"`
	BlockSize      int     `json:"block_size"`
	CapacityBlocks int     `json:"capacity_blocks"`
	HashAlgo       string  `json:"hash_algo"`
	Requests       uint64  `json:"requests"`
	Queries        uint64  `json:"queries"`
	Completed      uint64  `json:"completed"`
	Failed         uint64  `json:"failed"`
	PromptTokens   uint64  `json:"prompt_tokens"`
	HitTokens      uint64  `json:"hit_tokens"`
	HitRatio       float64 `json:"hit_ratio"`
	OutputTokens   uint64  `json:"output_tokens"`
	Running        int64   `json:"running"`
	Waiting        int64   `json:"waiting"`
	BlocksUsed     int     `json:"blocks_used"`
	KVUsage        float64 `json:"kv_usage"`
	PDTransfers    uint64  `json:"pd_transfers"`
	PDClaimed      uint64  `json:"pd_claimed"`
	TRTQueued      int     `json:"trt_queued_events,omitempty"`
	TRTOverflow    uint64  `json:"trt_overflow_events,omitempty"`
	TRTDropped     uint64  `json:"trt_dropped_batches,omitempty"`
	// TRTDrainers counts POST /kv_cache_events by consumer (the
	// X-Loxilb-Node header, else the remote address).
	TRTDrainers map[string]uint64 `json:"trt_drainers,omitempty"`
	Ranks       []RankStats       `json:"ranks"`
}

// Stats reports counters and cache occupancy.
func (e *Engine) Stats() Stats {
	s := Stats{Engine: e.cfg.Engine, Role: e.cfg.Role, Model: e.cfg.Model, BlockSize: e.cfg.BlockSize,
		CapacityBlocks: e.cfg.CapacityBlocks, HashAlgo: e.hasher.algo(),
		Requests: e.requests.Load(), Queries: e.queries.Load(), Completed: e.completed.Load(), Failed: e.failed.Load(),
		PromptTokens: e.promptTok.Load(), HitTokens: e.hitTok.Load(), OutputTokens: e.outputTok.Load(),
		Running: e.sched.running.Load(), Waiting: e.sched.waiting.Load(),
		PDTransfers: e.transfers.Load(), PDClaimed: e.claimed.Load()}
	if e.cfg.Engine == EngineLlamaCpp {
		s.HashAlgo = ""
	}
	if s.PromptTokens > 0 {
		s.HitRatio = float64(s.HitTokens) / float64(s.PromptTokens)
	}
	for _, r := range e.ranks {
		r.mu.Lock()
		rs := RankStats{Rank: r.id, BlocksUsed: len(r.cache.blocks), Evictions: r.cache.evictions, CPUBlocks: r.cache.cpuLen(), Uncacheable: r.cache.dropped,
			Served: r.served.Load(), Targeted: r.targeted.Load()}
		r.mu.Unlock()
		if r.pub != nil {
			rs.NextSeq = r.pub.currentSeq()
			rs.Enqueued = r.pub.enqueued.Load()
			rs.Published = r.pub.published.Load()
			rs.Dropped = r.pub.dropped.Load()
			rs.Reordered = r.pub.reordered.Load()
			rs.Replays = r.pub.replays.Load()
			rs.Lost = r.pub.lost.Load()
			rs.Subscribers = r.pub.subscribers()
		}
		s.BlocksUsed += rs.BlocksUsed
		s.Ranks = append(s.Ranks, rs)
	}
	s.KVUsage = float64(s.BlocksUsed) / float64(e.cfg.CapacityBlocks*len(e.ranks))
	if e.trt != nil {
		e.trt.mu.Lock()
		s.TRTQueued = len(e.trt.events)
		s.TRTDrainers = maps.Clone(e.trt.drainers)
		e.trt.mu.Unlock()
		s.TRTOverflow = e.trt.overflow.Load()
		s.TRTDropped = e.trt.dropped.Load()
	}
	return s
}

// RankCache lists one rank's resident blocks.
type RankCache struct {
	Rank   int         `json:"rank"`
	Blocks []BlockInfo `json:"blocks"`
	// CPU lists the keys in the CPU offload tier, most recently offloaded
	// first (only with CPUOffloadBlocks).
	CPU []uint64 `json:"cpu,omitempty"`
}

// CacheSnapshot is the body of GET /sim/cache: the ground-truth block keys
// (the u64 the engine publishes; SGLang's int64 as its uint64 bit pattern),
// sorted per rank. JSON readers must decode the numbers as uint64.
type CacheSnapshot struct {
	Engine    string      `json:"engine"`
	BlockSize int         `json:"block_size"`
	HashAlgo  string      `json:"hash_algo"`
	Ranks     []RankCache `json:"ranks"`
}

// Cache returns the resident blocks of every rank.
func (e *Engine) Cache() CacheSnapshot {
	cs := CacheSnapshot{Engine: e.cfg.Engine, BlockSize: e.cfg.BlockSize, HashAlgo: e.hasher.algo()}
	for _, r := range e.ranks {
		r.mu.Lock()
		cs.Ranks = append(cs.Ranks, RankCache{Rank: r.id, Blocks: r.cache.snapshot(), CPU: r.cache.cpuKeys()})
		r.mu.Unlock()
	}
	return cs
}

func (e *Engine) kvUsage() float64 {
	used := 0
	for _, r := range e.ranks {
		r.mu.Lock()
		used += len(r.cache.blocks)
		r.mu.Unlock()
	}
	return float64(used) / float64(e.cfg.CapacityBlocks*len(e.ranks))
}

// scheduler bounds concurrent sequences; excess requests wait in FIFO-ish
// order (Go channel fairness) and are counted as waiting.
type scheduler struct {
	slots            chan struct{}
	maxQueue         int64
	running, waiting atomic.Int64
}

func newScheduler(maxRunning, maxQueue int) *scheduler {
	return &scheduler{slots: make(chan struct{}, maxRunning), maxQueue: int64(maxQueue)}
}

func (s *scheduler) acquire(ctx context.Context) error {
	if w := s.waiting.Add(1); s.maxQueue > 0 && w > s.maxQueue {
		s.waiting.Add(-1)
		return fmt.Errorf("%w: %d requests waiting", ErrOverloaded, w-1)
	}
	defer s.waiting.Add(-1)
	select {
	case s.slots <- struct{}{}:
		s.running.Add(1)
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

func (s *scheduler) release() {
	s.running.Add(-1)
	<-s.slots
}

// sleep waits d scaled by the time-scale knob, or until ctx ends.
func (e *Engine) sleep(ctx context.Context, d time.Duration) error {
	d = time.Duration(float64(d) * e.cfg.TimeScale)
	if d <= 0 {
		return ctx.Err()
	}
	return e.sleepf(ctx, d)
}

func timerSleep(ctx context.Context, d time.Duration) error {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}
