package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"strings"
	"sync"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"

	"github.com/loxilb-llm/loxilb/api"
	"github.com/loxilb-llm/loxilb/pkg/control"
	"github.com/loxilb-llm/loxilb/pkg/dataplane"
	"github.com/loxilb-llm/loxilb/pkg/dataplane/ebpf"
	"github.com/loxilb-llm/loxilb/pkg/gcfloor"
	"github.com/loxilb-llm/loxilb/pkg/health"
	"github.com/loxilb-llm/loxilb/pkg/kvevents"
	"github.com/loxilb-llm/loxilb/pkg/kvindex"
	"github.com/loxilb-llm/loxilb/pkg/lbrule"
	"github.com/loxilb-llm/loxilb/pkg/tokenizer"
)

// runner is one long-lived component.
type runner struct {
	name string
	run  func(context.Context) error
}

// run is the daemon: flags and environment into a configuration, every
// component built from it, then served until ctx ends or one fails.
func run(ctx context.Context, args []string, env func(string) (string, bool)) error {
	if len(args) > 0 && args[0] == "cleanup" {
		return cleanup(args[1:], os.Stdout, os.Stderr)
	}
	cfg, err := parseFlags(args, env, os.Stderr)
	if err != nil {
		return err
	}
	if cfg.showVersion {
		fmt.Println(version)
		return nil
	}
	// The management API's exposure is checked before anything is opened
	// or bound: a refused configuration leaves no trace.
	apiCfg := cfg.apiConfig()
	if err := apiCfg.Validate(); err != nil {
		return err
	}
	// GC pacing first: the start-up's own allocations (tokenizers, the
	// store) are paced by it too. GOGC in the environment is the
	// operator's choice and wins.
	if _, set := env("GOGC"); !set && cfg.gcHeapFloor > 0 {
		pacer := gcfloor.Start(uint64(cfg.gcHeapFloor))
		defer pacer.Stop()
	}
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	d := &daemon{cfg: cfg, logger: cfg.logger(os.Stderr), reg: reg}
	defer d.close()
	for _, step := range []func() error{d.openStore, d.buildKVPlane, d.buildRouting, d.buildProxy, d.buildControl, d.joinCluster} {
		if err := step(); err != nil {
			return err
		}
	}
	return d.serve(ctx, apiCfg)
}

// kernelPlane is what openDataplane hands back: the capability entry, the
// data plane when it runs (nil otherwise), the steered proxy listener and
// what to do at exit.
type kernelPlane struct {
	capab   api.Capability
	dp      dataplane.Dataplane
	steered net.Listener
	close   func()
}

// openDataplane loads the eBPF data plane unless disabled. Without root or
// BPF support the daemon still runs, proxy-only: it says so once and the
// ebpf_dataplane capability carries the reason. A mistake in the data
// plane's configuration (an interface that does not exist) is an error: the
// daemon stops before touching what a previous run left pinned.
func openDataplane(cfg *config, ctl *control.Controller, prober *health.Prober, logger *slog.Logger, reg prometheus.Registerer) (kernelPlane, error) {
	kp := kernelPlane{capab: api.Capability{Name: "ebpf_dataplane"}, close: func() {}}
	capab := &kp.capab
	if cfg.noDataplane {
		capab.ReasonCode, capab.Reason = "disabled", "disabled with --no-dataplane: modes 0-3 and 5 are not served; mode 4 runs in the proxy"
		ctl.AddReconciler(control.KernelUnavailable{Why: capab.Reason})
		return kp, nil
	}
	dp, c, err := ebpf.Open(ebpf.Config{Interfaces: cfg.interfaces, PinPath: cfg.bpfPinPath}, logger, reg)
	capab.Ready, capab.Reason = c.Ready, c.Reason
	if errors.Is(err, dataplane.ErrConfig) {
		return kp, fmt.Errorf("eBPF data plane (--interfaces %q, --bpf-pin-path %s): %w", strings.Join(cfg.interfaces, ","), cfg.bpfPinPath, err)
	}
	if err != nil {
		capab.ReasonCode = "unavailable"
		logger.Warn("eBPF data plane unavailable: running proxy-only (mode 4); rules of modes 0-3 and 5 will be refused", "reason", c.Reason)
		ctl.AddReconciler(control.KernelUnavailable{Why: "unavailable: " + c.Reason})
		return kp, nil
	}
	if len(cfg.interfaces) == 0 {
		// Mode 4 is steered, but no packet reaches tc_lb: refuse what
		// would be accepted and never served.
		capab.Ready, capab.ReasonCode = false, "no_interfaces"
		ctl.AddReconciler(control.KernelUnavailable{Code: control.ReasonNoInterfaces,
			Why: "the data plane is attached to no interface: restart the daemon with --interfaces naming the interfaces the VIPs' traffic arrives on"})
		logger.Warn("eBPF data plane attached to no interface (no --interfaces): rules of modes 0-3 and 5 will be refused; mode 4 is steered")
	}
	kr := &control.KernelReconciler{DP: dp, Healthy: prober.Healthy}
	if steer, ok := dp.(dataplane.ProxySteerer); ok {
		// One listener receives every mode-4 VIP:port connection, steered by
		// sk_lookup; the proxy matches each to its rule by local address.
		// A plain TCP socket: SOCKMAP refuses MPTCP ones, Go's default.
		var lc net.ListenConfig
		lc.SetMultipathTCP(false)
		ln, err := lc.Listen(context.Background(), "tcp", "127.0.0.1:0")
		if err == nil {
			port := uint16(ln.Addr().(*net.TCPAddr).Port)
			if err = steer.RegisterProxyListener(port, ln.(*net.TCPListener)); err == nil {
				kr.ProxyPort = port
				kp.steered = ln
			} else {
				ln.Close()
			}
		}
		if err != nil {
			logger.Warn("mode-4 steering unavailable: the proxy binds each VIP:port itself", "err", err)
		}
	}
	ctl.AddReconciler(kr)
	unsubscribe := prober.Subscribe(func(ch health.Change) {
		if err := kr.SetHealth(context.Background(), ch.Service, ch.EP, ch.Healthy); err != nil {
			logger.Error("data plane endpoint health", "service", ch.Service, "ep", ch.EP, "err", err)
		}
	})
	logger.Info("eBPF data plane ready", "detail", c.Reason, "interfaces", cfg.interfaces, "mode4_steering", kr.ProxyPort != 0)
	kp.dp, kp.close = dp, func() { unsubscribe(); _ = dp.Close() }
	return kp, nil
}

// inspector serves the inventory API from the index and the subscribers.
type inspector struct {
	index  *kvindex.Index
	events *kvevents.Manager
}

func (i inspector) Snapshot(service uint32, ep, limit int) ([]uint64, int) {
	return i.index.Snapshot(service, ep, limit)
}

func (i inspector) Subscriber(service uint32, ep int) (any, bool) {
	st, ok := i.events.Status(service, ep)
	return st, ok
}

func tokenizerCaps(r *tokenizer.Registry) []api.Capability {
	var out []api.Capability
	for _, s := range r.Status() {
		c := api.Capability{Name: "tokenizer:" + s.Model, Ready: s.Loaded}
		if s.Model == "" {
			c.Name = "tokenizer:" + s.Slug
		}
		if !s.Loaded {
			c.ReasonCode, c.Reason = s.Reason, s.Error
			if c.Reason == "" {
				c.Reason = "staged at " + s.Path + ", loaded on first request"
			}
		}
		out = append(out, c)
	}
	return out
}

// ruleCaps is the "rules" capability: how many rules are applied,
// degraded and failed, and which are not applied.
func ruleCaps(list []control.Service) api.Capability {
	c := api.Capability{Name: "rules", Ready: true,
		Counts: map[string]int{control.StateApplied: 0, control.StateDegraded: 0, control.StateFailed: 0}}
	var bad []string
	for _, s := range list {
		c.Counts[s.Status.State]++
		if s.Status.State != control.StateApplied && len(bad) < 8 {
			bad = append(bad, fmt.Sprintf("rule %d (%s) %s %s", s.ID, s.Rule.Key(), s.Status.State, s.Status.Reason))
		}
	}
	c.Reason = fmt.Sprintf("%d applied, %d degraded, %d failed", c.Counts[control.StateApplied], c.Counts[control.StateDegraded], c.Counts[control.StateFailed])
	switch {
	case c.Counts[control.StateFailed] > 0:
		c.Ready, c.ReasonCode = false, "rules_failed"
	case c.Counts[control.StateDegraded] > 0:
		c.Ready, c.ReasonCode = false, "rules_degraded"
	}
	if len(bad) > 0 {
		c.Reason += ": " + strings.Join(bad, "; ")
	}
	return c
}

func parityCaps(m *kvevents.Manager) []api.Capability {
	var out []api.Capability
	for _, p := range m.Parity() {
		c := api.Capability{Name: fmt.Sprintf("kv_parity:%d/%d", p.Service, p.EPIdx), Ready: p.Verdict == "ok" && !p.Quarantined, ReasonCode: p.Verdict, Reason: p.Reason}
		out = append(out, c)
		if p.Quarantined {
			// Tier 1.5 is off for the endpoint: its inventory is empty.
			out = append(out, api.Capability{Name: fmt.Sprintf("kv_quarantine:%d/%d", p.Service, p.EPIdx),
				ReasonCode: "quarantined", Reason: p.QuarantineReason})
		}
	}
	return out
}

// capabilities assembles GET /status/capabilities from every stage.
type capabilities struct {
	rules   lbrule.Settings
	mu      sync.Mutex
	sources []func() []api.Capability
}

func (c *capabilities) add(f func() []api.Capability) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.sources = append(c.sources, f)
}

func (c *capabilities) list() []api.Capability {
	vllm := api.Capability{Name: "kv_exact_vllm", Ready: true}
	if e := lbrule.SeedPrecondition(c.rules); e != nil {
		vllm.Ready, vllm.ReasonCode, vllm.Reason = false, e.Reason, e.Msg
	}
	out := []api.Capability{vllm}
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, f := range c.sources {
		out = append(out, f()...)
	}
	return out
}
