package fleet

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"net"
	"net/http"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/loxilb-llm/loxilb/testbed/enginesim"
)

// Member is one running engine of a fleet.
type Member struct {
	Name          string
	Engine        string
	Role          string
	Addr          string // HTTP host:port
	URL           string // http://host:port
	ZMQPorts      []int  // PUB port per DP rank (base+rank), empty without ZMQ events
	ReplayPorts   []int  // ROUTER port per DP rank (PUB port + 1000)
	BootstrapPort int    // SGLang prefill bootstrap port, else 0
	BlockSize     int

	// Sim is the engine itself for in-process members (nil for processes),
	// so tests can read its cache or inject faults without HTTP.
	Sim *enginesim.Engine

	cmd  *exec.Cmd
	done chan error
	stop context.CancelFunc
}

// Options tune a fleet. All fields are optional.
type Options struct {
	Logger *slog.Logger
	// Deps are handed to in-process engines (tokenizer, clock).
	Deps enginesim.Deps
	// ReadyTimeout bounds the wait for each engine's /health (default 30s).
	ReadyTimeout time.Duration
	// Stderr receives the log output of engine processes (default discarded).
	Stderr io.Writer
	// TokenizerDir, when set, gives every engine that model tokenizer
	// (in-process engines load it once unless Deps.Tokenizer is set).
	TokenizerDir string
}

// Fleet is a set of emulated engines on loopback ports.
type Fleet struct {
	Members []*Member
	log     *slog.Logger
	stopMu  sync.Mutex
	stopped bool
}

// bindAttempts bounds retries when a picked port is taken between the
// check and the bind by another process on the machine.
const bindAttempts = 8

// Start runs one in-process engine per config on 127.0.0.1. Unset ports
// are allocated: the HTTP port is free-picked, ZMQ ports are a contiguous
// free run base..base+ranks-1 with replay at base+1000+rank (the layout
// engines and the gateway assume), the bootstrap port is free-picked.
func Start(ctx context.Context, cfgs []enginesim.Config, opts Options) (*Fleet, error) {
	f := newFleet(opts)
	if opts.TokenizerDir != "" && opts.Deps.Tokenizer == nil {
		tok, err := enginesim.LoadTokenizer(opts.TokenizerDir)
		if err != nil {
			return nil, err
		}
		opts.Deps.Tokenizer = tok
	}
	for i, c := range cfgs {
		m, err := f.startInProcess(ctx, i, c, opts)
		if err != nil {
			f.Stop()
			return nil, err
		}
		f.Members = append(f.Members, m)
	}
	if err := f.WaitHealthy(ctx, opts.readyTimeout()); err != nil {
		f.Stop()
		return nil, err
	}
	return f, nil
}

// StartProcesses runs one engine-sim process (bin, e.g. bin/engine-sim) per
// config and reads each one's ready line for its addresses.
func StartProcesses(ctx context.Context, bin string, cfgs []enginesim.Config, opts Options) (*Fleet, error) {
	f := newFleet(opts)
	for i, c := range cfgs {
		m, err := f.startProcess(ctx, bin, i, c, opts)
		if err != nil {
			f.Stop()
			return nil, err
		}
		f.Members = append(f.Members, m)
	}
	if err := f.WaitHealthy(ctx, opts.readyTimeout()); err != nil {
		f.Stop()
		return nil, err
	}
	return f, nil
}

func newFleet(opts Options) *Fleet {
	log := opts.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	return &Fleet{log: log}
}

func (o Options) readyTimeout() time.Duration {
	if o.ReadyTimeout > 0 {
		return o.ReadyTimeout
	}
	return 30 * time.Second
}

// Uniform returns n copies of cfg, a convenience for homogeneous fleets.
func Uniform(n int, cfg enginesim.Config) []enginesim.Config {
	out := make([]enginesim.Config, n)
	for i := range out {
		out[i] = cfg
	}
	return out
}

func hasZMQ(c enginesim.Config) bool {
	e := c.Engine
	return (e == "" || e == enginesim.EngineVLLM || e == enginesim.EngineSGLang) && c.ZMQPort >= 0
}

// prepare fills the ports the fleet allocates.
func prepare(c enginesim.Config) (enginesim.Config, error) {
	if c.Listen == "" {
		c.Listen = "127.0.0.1:0"
	}
	if hasZMQ(c) && c.ZMQPort == 0 {
		ranks := max(c.DPRanks, 1)
		base, err := freeRun(ranks)
		if err != nil {
			return c, err
		}
		c.ZMQPort = base
		if c.ReplayPort == 0 {
			c.ReplayPort = base + 1000
		}
	}
	return c, nil
}

// freeRun finds base such that base..base+n-1 and base+1000..base+1000+n-1
// are all bindable on 127.0.0.1 right now.
func freeRun(n int) (int, error) {
	for try := 0; try < 200; try++ {
		base := 20000 + rand.IntN(10000)
		ok := true
		for _, off := range []int{0, 1000} {
			for r := 0; r < n && ok; r++ {
				l, err := net.Listen("tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(base+off+r)))
				if err != nil {
					ok = false
					break
				}
				l.Close()
			}
		}
		if ok {
			return base, nil
		}
	}
	return 0, errors.New("no free run of loopback ports for ZMQ events")
}

func name(i int, c enginesim.Config) string {
	e, r := c.Engine, c.Role
	if e == "" {
		e = enginesim.EngineVLLM
	}
	if r == "" {
		r = enginesim.RoleBoth
	}
	return fmt.Sprintf("%s-%s-%d", e, r, i)
}

func (f *Fleet) startInProcess(ctx context.Context, i int, c enginesim.Config, opts Options) (*Member, error) {
	var lastErr error
	for attempt := 0; attempt < bindAttempts; attempt++ {
		pc, err := prepare(c)
		if err != nil {
			return nil, err
		}
		deps := opts.Deps
		if deps.Logger == nil {
			deps.Logger = f.log
		}
		e, err := enginesim.New(pc, deps)
		if err != nil {
			lastErr = err
			if c.ZMQPort == 0 && hasZMQ(c) {
				continue // probably a port race: pick again
			}
			break
		}
		rctx, cancel := context.WithCancel(context.WithoutCancel(ctx))
		m := &Member{Name: name(i, c), Sim: e, stop: cancel, done: make(chan error, 1)}
		m.fill(e.Config().Engine, e.Config().Role, e.Addr(), e.ZMQPorts(), e.ReplayPorts(), e.BootstrapPort(), e.Config().BlockSize)
		go func() { m.done <- e.Run(rctx) }()
		return m, nil
	}
	return nil, fmt.Errorf("start %s: %w", name(i, c), lastErr)
}

func (m *Member) fill(engine, role, addr string, zmq, replay []int, boot, bs int) {
	m.Engine, m.Role, m.Addr, m.URL = engine, role, addr, "http://"+addr
	m.ZMQPorts, m.ReplayPorts, m.BootstrapPort, m.BlockSize = zmq, replay, boot, bs
}

// Args renders a config as engine-sim flags.
func Args(c enginesim.Config) []string {
	d := c.Defaults()
	a := []string{
		"--engine", d.Engine, "--role", d.Role, "--listen", d.Listen, "--model", d.Model,
		"--max-model-len", strconv.Itoa(d.MaxModelLen), "--block-size", strconv.Itoa(d.BlockSize),
		"--capacity-blocks", strconv.Itoa(d.CapacityBlocks), "--zmq-bind", d.ZMQBind,
		"--zmq-port", strconv.Itoa(d.ZMQPort), "--replay-port", strconv.Itoa(d.ReplayPort),
		"--dp-ranks", strconv.Itoa(d.DPRanks), "--topic", d.Topic, "--buffer-steps", strconv.Itoa(d.BufferSteps),
		"--replay-format", d.ReplayFormat, "--hash-algo", d.HashAlgo, "--seed", d.Seed,
		"--event-encoding", d.EventEncoding,
		"--prefill-us-per-token", ftoa(d.PrefillUsPerToken), "--decode-us-per-token", ftoa(d.DecodeUsPerToken),
		"--decode-us-per-active-block", ftoa(d.DecodeUsPerActiveBlock),
		"--max-running", strconv.Itoa(d.MaxRunning), "--max-queue", strconv.Itoa(d.MaxQueue),
		"--time-scale", ftoa(d.TimeScale), "--bootstrap-port", strconv.Itoa(d.BootstrapPort),
		"--pd-timeout", d.PDTimeout.String(), "--trt-event-buffer", strconv.Itoa(d.TRTEventBuffer),
		"--rand-seed", strconv.FormatUint(d.RandSeed, 10),
		"--fault-drop-prob", ftoa(d.Faults.DropProb), "--fault-drop-batches", strconv.Itoa(d.Faults.DropBatches),
		"--fault-reorder-batches", strconv.Itoa(d.Faults.ReorderBatches),
		"--fault-reorder-hold-ms", strconv.Itoa(d.Faults.ReorderHoldMs),
		"--fault-event-delay-ms", strconv.Itoa(d.Faults.EventDelayMs), "--fault-stall-ms", strconv.Itoa(d.Faults.StallMs),
		"--fault-fail-requests", strconv.Itoa(d.Faults.FailRequests), "--fault-close-mid-stream", strconv.Itoa(d.Faults.CloseMidStream),
	}
	if d.Faults.FailStatus != 0 {
		a = append(a, "--fault-fail-status", strconv.Itoa(d.Faults.FailStatus))
	}
	if d.AdvertiseHost != "" {
		a = append(a, "--advertise-host", d.AdvertiseHost)
	}
	if d.BytesBlockHashes {
		a = append(a, "--bytes-block-hashes")
	}
	if len(d.LoRAModules) > 0 {
		a = append(a, "--lora-modules", strings.Join(d.LoRAModules, ","))
	}
	if d.SGLangPartialPages {
		a = append(a, "--sglang-partial-pages")
	}
	return a
}

func ftoa(v float64) string { return strconv.FormatFloat(v, 'g', -1, 64) }

type readyLine struct {
	Ready         bool   `json:"ready"`
	Engine        string `json:"engine"`
	Role          string `json:"role"`
	HTTP          string `json:"http"`
	ZMQPorts      []int  `json:"zmq_ports"`
	ReplayPorts   []int  `json:"replay_ports"`
	BootstrapPort int    `json:"bootstrap_port"`
}

func (f *Fleet) startProcess(ctx context.Context, bin string, i int, c enginesim.Config, opts Options) (*Member, error) {
	var lastErr error
	for attempt := 0; attempt < bindAttempts; attempt++ {
		pc, err := prepare(c)
		if err != nil {
			return nil, err
		}
		if pc.TimeScale == 0 && !pc.TimeScaleSet {
			pc.TimeScale = 1
		}
		pc.TimeScaleSet = true
		args := Args(pc)
		if opts.TokenizerDir != "" {
			args = append(args, "--tokenizer-dir", opts.TokenizerDir)
		}
		cmd := exec.Command(bin, args...)
		cmd.Stderr = opts.Stderr
		out, err := cmd.StdoutPipe()
		if err != nil {
			return nil, fmt.Errorf("stdout pipe: %w", err)
		}
		if err := cmd.Start(); err != nil {
			return nil, fmt.Errorf("start %s: %w", bin, err)
		}
		m := &Member{Name: name(i, c), cmd: cmd, done: make(chan error, 1)}
		lineCh := make(chan []byte, 1)
		go func() {
			br := bufio.NewReader(out)
			line, _ := br.ReadBytes('\n')
			lineCh <- line
			_, _ = io.Copy(io.Discard, br)
		}()
		go func() { m.done <- cmd.Wait() }()
		var line []byte
		select {
		case line = <-lineCh:
		case <-time.After(opts.readyTimeout()):
			_ = cmd.Process.Kill()
			<-m.done
			return nil, fmt.Errorf("%s: no ready line within %s", m.Name, opts.readyTimeout())
		case <-ctx.Done():
			_ = cmd.Process.Kill()
			<-m.done
			return nil, ctx.Err()
		}
		var r readyLine
		if err := json.Unmarshal(line, &r); err != nil || !r.Ready {
			werr := <-m.done
			lastErr = fmt.Errorf("%s exited before ready (%v)", m.Name, werr)
			if c.ZMQPort == 0 {
				continue // probably a port race: pick again
			}
			return nil, lastErr
		}
		m.fill(r.Engine, r.Role, r.HTTP, r.ZMQPorts, r.ReplayPorts, r.BootstrapPort, pc.Defaults().BlockSize)
		return m, nil
	}
	return nil, lastErr
}

// WaitHealthy polls every member's /health until it answers 200.
func (f *Fleet) WaitHealthy(ctx context.Context, timeout time.Duration) error {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	client := &http.Client{Timeout: 2 * time.Second}
	for _, m := range f.Members {
		for {
			req, _ := http.NewRequestWithContext(ctx, http.MethodGet, m.URL+"/health", nil)
			resp, err := client.Do(req)
			if err == nil {
				resp.Body.Close()
				if resp.StatusCode == http.StatusOK {
					break
				}
			}
			select {
			case <-ctx.Done():
				return fmt.Errorf("%s at %s not healthy: %w", m.Name, m.URL, ctx.Err())
			case <-time.After(20 * time.Millisecond):
			}
		}
	}
	return nil
}

// ByRole returns the members with the given role.
func (f *Fleet) ByRole(role string) []*Member {
	var out []*Member
	for _, m := range f.Members {
		if m.Role == role {
			out = append(out, m)
		}
	}
	return out
}

// Stats reads /sim/stats of every member (works for processes too).
func (f *Fleet) Stats(ctx context.Context) ([]enginesim.Stats, error) {
	out := make([]enginesim.Stats, len(f.Members))
	for i, m := range f.Members {
		req, _ := http.NewRequestWithContext(ctx, http.MethodGet, m.URL+"/sim/stats", nil)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			return nil, fmt.Errorf("%s stats: %w", m.Name, err)
		}
		err = json.NewDecoder(resp.Body).Decode(&out[i])
		resp.Body.Close()
		if err != nil {
			return nil, fmt.Errorf("%s stats: %w", m.Name, err)
		}
	}
	return out, nil
}

// Stop ends every member: in-process engines are shut down, processes get
// SIGTERM and, if they linger, SIGKILL. It is safe to call more than once.
func (f *Fleet) Stop() error {
	f.stopMu.Lock()
	defer f.stopMu.Unlock()
	if f.stopped {
		return nil
	}
	f.stopped = true
	var errs []error
	for _, m := range f.Members {
		if err := m.halt(); err != nil {
			errs = append(errs, fmt.Errorf("%s: %w", m.Name, err))
		}
	}
	return errors.Join(errs...)
}

func (m *Member) halt() error {
	if m.stop != nil {
		m.stop()
		return <-m.done
	}
	if m.cmd == nil || m.cmd.Process == nil {
		return nil
	}
	_ = m.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case err := <-m.done:
		var ee *exec.ExitError
		if errors.As(err, &ee) && !ee.Success() {
			if ws, ok := ee.Sys().(syscall.WaitStatus); ok && ws.Signaled() {
				return nil
			}
		}
		return err
	case <-time.After(5 * time.Second):
		_ = m.cmd.Process.Kill()
		<-m.done
		return errors.New("did not exit on SIGTERM; killed")
	}
}
