//go:build linux

package ebpf

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/netip"
	"os"
	"strings"
	"sync"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/loxilb-llm/loxilb/pkg/dataplane"
)

// Config configures the eBPF data plane.
type Config struct {
	// Interfaces are the devices tc_lb is attached to (TC ingress). Empty
	// means none: the daemon never attaches to every interface by itself.
	Interfaces []string
	// PinPath is a directory on bpffs (e.g. /sys/fs/bpf/loxilb). When set,
	// maps and links are pinned there and survive Close and a daemon
	// restart. Empty means nothing is pinned and Close detaches everything.
	PinPath string
	// GCInterval is how often expired conntrack entries are removed.
	// Default 2s.
	GCInterval time.Duration
	// StackForwarding hands NATed packets to the kernel's forwarding path
	// instead of bpf_fib_lookup + bpf_redirect_neigh. DSR always uses the FIB.
	StackForwarding bool
	// HashSeed seeds the flow hash of the hash/persist/consistent-hash
	// selectors. Zero means the built-in seed (stable across restarts).
	HashSeed uint32
}

// Dataplane is the eBPF implementation of dataplane.Dataplane.
type Dataplane struct {
	cfg Config
	log *slog.Logger
	// pinLock holds the pin path's lock (see lockPinPath) from load until
	// Close, Purge or an abandoned start.
	pinLock *os.File

	mu        sync.Mutex
	gcMu      sync.Mutex // serialises GC passes, which run without mu
	closed    bool
	objs      lbObjects
	links     []tcxLink
	clsIfaces []int // interfaces using the cls_bpf fallback
	skLink    link.Link
	skFromPin bool // skLink was re-used from its pin, so it serves the previous run's state
	services  map[uint32]*svcState
	frontends map[lbSvcKey]uint32 // installed frontend -> service ID
	idxUsed   [dataplane.MaxServices]bool
	// idxGen counts the services an index has held (resetIndex), so a GC
	// pass drops the sums it made for an index that changed hands.
	idxGen     [dataplane.MaxServices]uint32
	proxySlots map[uint16]uint32        // proxy listener port -> lb_proxy_socks key
	routes     map[netip.Addr]*vipRoute // mode-4 VIPs made local, by VIP
	nCPU       int

	fib          *fibWatch // bumps lb_fib_gen on routing changes
	ctEntries    int       // conntrack entries seen by the last GC pass
	staleRemoved uint64    // recovered services removed because the control plane does not hold them
	gcStop       chan struct{}
	gcDone       chan struct{}
}

// vipRoute tracks the services using a mode-4 VIP and whether the local
// route is ours to remove.
type vipRoute struct {
	users map[uint32]bool
	ours  bool
}

type svcState struct {
	svc  dataplane.Service
	eps  []dataplane.Endpoint
	idx  uint16
	gen  uint8
	keys []lbSvcKey
	// cells holds each endpoint's counter/epoch cell (see lb_ep_epoch):
	// an endpoint keeps its cell across updates while it stays.
	cells map[epID]uint8
	// recovered is true from recover until the first upsert of the ID: the
	// service comes from the pinned maps, not from this process's control
	// plane, and PruneRecovered removes it if nobody claims it.
	recovered bool
}

// tcxLink is tc_lb's TCX attachment to one interface.
type tcxLink struct {
	link.Link
	ifname string
	// fromPin is true when the link was re-used from its pin: it carried
	// traffic before this process started, so a failed start must leave it
	// attached and pinned.
	fromPin bool
}

var (
	_ dataplane.Dataplane    = (*Dataplane)(nil)
	_ dataplane.ProxySteerer = (*Dataplane)(nil)
	_ dataplane.Recoverer    = (*Dataplane)(nil)
	_ dataplane.Checker      = (*Dataplane)(nil)
)

// Open loads and attaches the data plane. On failure (not root, no BPF or
// TCX support, a bad interface name) it returns the error and a not-ready
// capability whose Reason says why, so the daemon can run proxy-only.
func Open(cfg Config, logger *slog.Logger, reg prometheus.Registerer) (dataplane.Dataplane, dataplane.Capability, error) {
	capab := dataplane.Capability{Name: CapabilityName}
	d, err := New(cfg, logger)
	if err != nil {
		capab.Reason = err.Error()
		return nil, capab, err
	}
	if reg != nil {
		if err := reg.Register(newCollector(d)); err != nil {
			d.Close()
			capab.Reason = err.Error()
			return nil, capab, fmt.Errorf("register data plane metrics: %w", err)
		}
	}
	if len(cfg.Interfaces) == 0 {
		// Loaded and steering mode 4, but no packet reaches tc_lb: a rule
		// of modes 0-3 or 5 would be accepted and never served.
		capab.Reason = "tc_lb is attached to no interface (none configured): modes 0-3 and 5 are not served; sk_lookup steering of mode 4 is on"
		return d, capab, nil
	}
	capab.Ready = true
	capab.Reason = fmt.Sprintf("tc_lb attached to %s, sk_lookup steering on", strings.Join(cfg.Interfaces, ", "))
	return d, capab, nil
}

// checkInterfaces makes sure every configured interface exists, before
// anything is loaded or a pinned link touched: a mistyped name must stop the
// start, not take down what the previous run left attached.
func checkInterfaces(names []string) error {
	seen := map[string]bool{}
	for _, name := range names {
		if seen[name] {
			return fmt.Errorf("%w: interface %q is listed twice", dataplane.ErrConfig, name)
		}
		seen[name] = true
		if _, err := net.InterfaceByName(name); err != nil {
			var have []string
			if ifs, err := net.Interfaces(); err == nil {
				for _, i := range ifs {
					have = append(have, i.Name)
				}
			}
			return fmt.Errorf("%w: interface %q does not exist (present: %s): %w", dataplane.ErrConfig, name, strings.Join(have, ", "), err)
		}
	}
	return nil
}

// New is Open without metrics registration, returning the concrete type.
func New(cfg Config, logger *slog.Logger) (*Dataplane, error) {
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}
	if err := checkInterfaces(cfg.Interfaces); err != nil {
		return nil, err
	}
	if cfg.GCInterval <= 0 {
		cfg.GCInterval = 2 * time.Second
	}
	d := &Dataplane{
		cfg:        cfg,
		log:        logger,
		services:   map[uint32]*svcState{},
		frontends:  map[lbSvcKey]uint32{},
		proxySlots: map[uint16]uint32{},
		routes:     map[netip.Addr]*vipRoute{},
	}
	if os.Geteuid() != 0 {
		return nil, fmt.Errorf("%w: loading BPF programs needs root (CAP_BPF, CAP_NET_ADMIN); running proxy-only", dataplane.ErrUnsupported)
	}
	n, err := ebpf.PossibleCPU()
	if err != nil {
		return nil, fmt.Errorf("count CPUs: %w", err)
	}
	d.nCPU = n
	d.reserveSNATPorts()
	if err := d.load(); err != nil {
		return nil, err
	}
	if err := d.recover(); err != nil {
		d.objs.Close()
		d.unlockPinPath()
		return nil, err
	}
	if err := d.startFIBWatch(); err != nil {
		d.objs.Close()
		d.unlockPinPath()
		return nil, err
	}
	for _, ifname := range cfg.Interfaces {
		if err := d.attachTC(ifname); err != nil {
			d.fib.stop()
			d.abandon()
			return nil, err
		}
	}
	if err := d.pinProgs(); err != nil {
		d.fib.stop()
		d.abandon()
		return nil, err
	}
	if err := d.attachSkLookup(); err != nil {
		d.fib.stop()
		d.abandon()
		return nil, err
	}
	d.detachUnconfigured()
	d.gcStop = make(chan struct{})
	d.gcDone = make(chan struct{})
	go d.gcLoop()
	return d, nil
}

func (d *Dataplane) load() error {
	spec, err := loadLb()
	if err != nil {
		return fmt.Errorf("parse embedded BPF object: %w", err)
	}
	fib := uint8(1)
	if d.cfg.StackForwarding {
		fib = 0
	}
	if err := spec.Variables[lbVarCfgFibForward].Set(fib); err != nil {
		return fmt.Errorf("set cfg_fib_forward: %w", err)
	}
	if d.cfg.HashSeed != 0 {
		if err := spec.Variables[lbVarCfgHashSeed].Set(d.cfg.HashSeed); err != nil {
			return fmt.Errorf("set cfg_hash_seed: %w", err)
		}
	}
	opts := &ebpf.CollectionOptions{}
	if d.cfg.PinPath != "" {
		if err := ensureBPFFS(d.cfg.PinPath); err != nil {
			return err
		}
		if err := os.MkdirAll(d.cfg.PinPath, 0o700); err != nil {
			return fmt.Errorf("create pin directory: %w", err)
		}
		lock, err := lockPinPath(d.cfg.PinPath)
		if err != nil {
			return err
		}
		d.pinLock = lock
		opts.Maps.PinPath = d.cfg.PinPath
		d.dropIncompatiblePins(spec)
	} else {
		for _, m := range spec.Maps {
			m.Pinning = ebpf.PinNone
		}
	}
	if err := spec.LoadAndAssign(&d.objs, opts); err != nil {
		d.unlockPinPath()
		var ve *ebpf.VerifierError
		if errors.As(err, &ve) {
			d.log.Error("BPF verifier rejected the program", "log", fmt.Sprintf("%+v", ve))
		}
		if errors.Is(err, ebpf.ErrMapIncompatible) {
			return fmt.Errorf("load BPF objects: pinned maps under %s come from an incompatible version (run with a fresh --bpf-pin-path, or remove the old state with loxilb cleanup): %w", d.cfg.PinPath, err)
		}
		return fmt.Errorf("%w: load BPF objects: %w", dataplane.ErrUnsupported, err)
	}
	return nil
}

// Close stops conntrack GC and releases file descriptors. With a PinPath the
// programs stay attached and the maps stay pinned, so forwarding continues;
// without one everything is detached.
func (d *Dataplane) Close() error {
	d.mu.Lock()
	if d.closed {
		d.mu.Unlock()
		return nil
	}
	d.closed = true
	d.mu.Unlock()
	close(d.gcStop)
	<-d.gcDone
	d.fib.stop()

	d.mu.Lock()
	defer d.mu.Unlock()
	if d.cfg.PinPath == "" {
		d.detach()
		for vip := range d.routes {
			d.delLocalRoute(vip)
		}
	} else {
		for _, l := range d.links {
			l.Close()
		}
		if d.skLink != nil {
			d.skLink.Close()
		}
	}
	defer d.unlockPinPath()
	return d.objs.Close()
}

// Stats implements dataplane.Dataplane.
func (d *Dataplane) Stats(ctx context.Context) (dataplane.Stats, error) {
	if err := ctx.Err(); err != nil {
		return dataplane.Stats{}, err
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.closed {
		return dataplane.Stats{}, dataplane.ErrClosed
	}
	st := dataplane.Stats{
		Counters:         make(map[string]uint64, len(counterNames)),
		Services:         make(map[uint32]dataplane.ServiceStats, len(d.services)),
		ConntrackEntries: d.ctEntries,
	}
	per := make([]uint64, d.nCPU)
	for i, name := range counterNames {
		if err := d.objs.LbCounters.Lookup(uint32(i), &per); err != nil {
			return dataplane.Stats{}, fmt.Errorf("read counter %s: %w", name, err)
		}
		var sum uint64
		for _, v := range per {
			sum += v
		}
		st.Counters[name] = sum
	}
	foldCachedHits(st.Counters)
	for id, s := range d.services {
		out, err := d.serviceStats(s.idx)
		if err != nil {
			return dataplane.Stats{}, fmt.Errorf("read counters of service %d: %w", id, err)
		}
		st.Services[id] = out
	}
	return st, nil
}

// ProgramRuntime returns how often tc_lb ran and its total run time, as
// counted by the kernel while BPF run-time statistics are enabled
// (kernel.bpf_stats_enabled or ebpf.EnableStats); otherwise both stay 0.
func (d *Dataplane) ProgramRuntime() (runs uint64, total time.Duration, err error) {
	st, err := d.objs.TcLb.Stats()
	if err != nil {
		return 0, 0, fmt.Errorf("tc_lb stats: %w", err)
	}
	return st.RunCount, st.Runtime, nil
}
