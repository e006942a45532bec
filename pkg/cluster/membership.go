package cluster

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sort"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// Backend is where nodes announce themselves: the shared store's leases.
type Backend interface {
	// Register stores value under name, attached to a lease of ttl that
	// is kept alive until Close, or until it is lost (the backend could
	// not be reached for a whole ttl). It fails when another live lease
	// holds name.
	Register(ctx context.Context, name string, value []byte, ttl time.Duration) (Registration, error)
	// Members returns every announced record by node name.
	Members(ctx context.Context) (map[string][]byte, error)
}

// Registration is one node's announcement under a live lease.
type Registration interface {
	// Update replaces the announced value, taking the name again if its
	// record was deleted while the lease lives.
	Update(ctx context.Context, value []byte) error
	// Lost is closed once the lease has ended without Close.
	Lost() <-chan struct{}
	// Close ends the lease: the record disappears at once.
	Close() error
}

// Config configures a Membership.
type Config struct {
	// Self is this node: Name, Address, Version and Started; its
	// Settings are taken from Local at every refresh.
	Self Member
	// Local returns the node's parity-relevant settings now.
	Local func() map[string]string
	// Backend is the shared store; nil for a single node, whose view is
	// itself alone.
	Backend Backend
	// BackendName names the backend in the view ("etcd").
	BackendName string
	// TTL is the lease's time to live: how long a node that died stays
	// listed. Default 10s, at least 2s (etcd's shortest lease).
	TTL time.Duration
	// Interval is how often the node re-announces changed settings and
	// re-reads the others. Default the smaller of 1s and TTL/3.
	Interval time.Duration
}

// Node is one member as the view shows it.
type Node struct {
	Member
	// Self marks the node that answered.
	Self bool `json:"self"`
	// State is StateOK, or StateDegraded when the node drifts.
	State string `json:"state"`
}

// Node states.
const (
	StateOK       = "ok"
	StateDegraded = "degraded"
)

// View is the cluster as one node sees it: the body of GET /cluster.
type View struct {
	// Backend is "single" for the embedded store, else the shared
	// store's name.
	Backend string `json:"backend"`
	// Self is the name of the node that answered.
	Self string `json:"self"`
	// TTLSeconds is the lease's time to live (0 for a single node).
	TTLSeconds int `json:"ttl_seconds"`
	// Registered is true while this node's announcement is live (always
	// for a single node).
	Registered bool `json:"registered"`
	// Reason says why this node is not registered, or why the others
	// could not be read (the nodes are then the last ones read).
	Reason string  `json:"reason,omitempty"`
	Nodes  []Node  `json:"nodes"`
	Drift  []Drift `json:"drift"`
	// Drifted is true when any setting differs between nodes.
	Drifted bool `json:"drifted"`
	// Invalid lists member records that could not be read.
	Invalid []string `json:"invalid,omitempty"`
	// ReadAt is when the others' records were last read.
	ReadAt time.Time `json:"read_at"`
}

// Membership announces this node and follows the others.
type Membership struct {
	cfg Config
	log *slog.Logger

	mu         sync.Mutex
	registered bool
	regErr     string
	readErr    string
	members    []Member // the others' records as last read (this node's included)
	invalid    []string
	readAt     time.Time
	lastDrift  string
}

// Lease bounds.
const (
	MinTTL     = 2 * time.Second
	MaxTTL     = 5 * time.Minute
	DefaultTTL = 10 * time.Second
)

// New checks cfg and registers the loxilb_cluster_* metrics on reg (nil:
// none).
func New(cfg Config, logger *slog.Logger, reg prometheus.Registerer) (*Membership, error) {
	if err := ValidName(cfg.Self.Name); err != nil {
		return nil, err
	}
	if cfg.Local == nil {
		cfg.Local = func() map[string]string { return nil }
	}
	if cfg.TTL == 0 {
		cfg.TTL = DefaultTTL
	}
	if cfg.TTL < MinTTL || cfg.TTL > MaxTTL || cfg.TTL%time.Second != 0 {
		return nil, fmt.Errorf("cluster lease ttl %v: want whole seconds within %v..%v", cfg.TTL, MinTTL, MaxTTL)
	}
	if cfg.Interval <= 0 {
		cfg.Interval = min(time.Second, cfg.TTL/3)
	}
	if cfg.BackendName == "" {
		cfg.BackendName = "etcd"
	}
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}
	m := &Membership{cfg: cfg, log: logger}
	if reg != nil {
		gauge := func(name, help string, f func(View) float64) prometheus.Collector {
			return prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: name, Help: help}, func() float64 { return f(m.View()) })
		}
		for _, c := range []prometheus.Collector{
			gauge("loxilb_cluster_nodes", "Gateway nodes announced in the shared store (this one included; 1 with the embedded store).",
				func(v View) float64 { return float64(len(v.Nodes)) }),
			gauge("loxilb_cluster_drift", "Parity-relevant settings (seed fingerprint, tokenizer checksums, routing settings) that differ between nodes.",
				func(v View) float64 { return float64(len(v.Drift)) }),
			gauge("loxilb_cluster_self_degraded", "1 while this node's settings drift from the other nodes'.",
				func(v View) float64 { return b2f(v.selfNode().State == StateDegraded) }),
			gauge("loxilb_cluster_registered", "1 while this node's announcement is live in the shared store.",
				func(v View) float64 { return b2f(v.Registered) }),
			gauge("loxilb_cluster_invalid_records", "Member records in the shared store that could not be read (malformed or over the limits).",
				func(v View) float64 { return float64(len(v.Invalid)) }),
		} {
			if err := reg.Register(c); err != nil {
				return nil, fmt.Errorf("cluster metrics: %w", err)
			}
		}
	}
	return m, nil
}

func b2f(b bool) float64 {
	if b {
		return 1
	}
	return 0
}

// self is this node's record now.
func (m *Membership) self() Member {
	s := m.cfg.Self
	s.Settings = m.cfg.Local()
	return s
}

// Run announces this node and re-reads the others every Interval until
// ctx ends, when the announcement is withdrawn. Without a Backend it
// returns at once.
func (m *Membership) Run(ctx context.Context) error {
	b := m.cfg.Backend
	if b == nil {
		return nil
	}
	var reg Registration
	defer func() {
		if reg != nil {
			_ = reg.Close()
		}
	}()
	t := time.NewTicker(m.cfg.Interval)
	defer t.Stop()
	var sent []byte
	for {
		val, err := m.self().Encode()
		switch {
		case err != nil:
			// Not expected (Local stays within the limits); reported,
			// never fatal to the node.
			m.setRegistered(fmt.Errorf("this node's record: %w", err))
		case reg == nil:
			rctx, cancel := context.WithTimeout(ctx, m.cfg.TTL)
			r, err := b.Register(rctx, m.cfg.Self.Name, val, m.cfg.TTL)
			cancel()
			if err == nil {
				reg, sent = r, val
				m.log.Info("cluster: registered", "node", m.cfg.Self.Name, "address", m.cfg.Self.Address, "ttl", m.cfg.TTL)
			}
			m.setRegistered(err)
		case !bytes.Equal(val, sent) || m.missing():
			uctx, cancel := context.WithTimeout(ctx, m.cfg.TTL)
			err := reg.Update(uctx, val)
			cancel()
			if err == nil {
				sent = val
			}
			m.setRegistered(err)
		}
		m.read(ctx)
		var lost <-chan struct{}
		if reg != nil {
			lost = reg.Lost()
		}
		select {
		case <-ctx.Done():
			return nil
		case <-lost:
			_ = reg.Close()
			reg = nil
			m.setRegistered(errors.New("lease lost (the store was unreachable for the lease's ttl): registering again"))
			m.log.Warn("cluster: lease lost, registering again", "node", m.cfg.Self.Name)
		case <-t.C:
		}
	}
}

// setRegistered records the outcome of the last announcement.
func (m *Membership) setRegistered(err error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	was := m.regErr
	m.registered, m.regErr = err == nil, ""
	if err != nil {
		m.regErr = err.Error()
		if m.regErr != was {
			m.log.Warn("cluster: this node is not announced", "node", m.cfg.Self.Name, "err", err)
		}
	}
}

// missing reports whether this node's record was absent at the last read
// while registered (someone deleted it).
func (m *Membership) missing() bool {
	m.mu.Lock()
	defer m.mu.Unlock()
	if !m.registered || m.readErr != "" || m.readAt.IsZero() {
		return false
	}
	for _, mem := range m.members {
		if mem.Name == m.cfg.Self.Name {
			return false
		}
	}
	return true
}

// read re-reads every member; on failure the last members read stay.
func (m *Membership) read(ctx context.Context) {
	rctx, cancel := context.WithTimeout(ctx, m.cfg.TTL)
	recs, err := m.cfg.Backend.Members(rctx)
	cancel()
	if err != nil {
		m.mu.Lock()
		m.readErr = "reading the other nodes: " + err.Error()
		m.mu.Unlock()
		return
	}
	var members []Member
	var invalid []string
	for name, b := range recs {
		mem, err := Decode(name, b)
		if err != nil {
			invalid = append(invalid, err.Error())
			continue
		}
		members = append(members, mem)
	}
	sort.Strings(invalid)
	m.mu.Lock()
	m.members, m.invalid, m.readErr, m.readAt = members, invalid, "", time.Now()
	m.mu.Unlock()
	m.logDrift()
}

// logDrift logs when the settings this node drifts on change.
func (m *Membership) logDrift() {
	v := m.View()
	why := strings.Join(DriftOf(v.Self, v.Drift), "; ")
	m.mu.Lock()
	changed := why != m.lastDrift
	m.lastDrift = why
	m.mu.Unlock()
	switch {
	case changed && why != "":
		m.log.Warn("cluster: this node's settings drift from the others'", "node", v.Self, "drift", why)
	case changed:
		m.log.Info("cluster: this node's settings agree with the others'", "node", v.Self, "nodes", len(v.Nodes))
	}
}

// View returns the cluster as last read, with this node's settings as
// they are now.
func (m *Membership) View() View {
	self := m.self()
	v := View{Backend: "single", Self: self.Name, Registered: true}
	members := []Member{self}
	if m.cfg.Backend != nil {
		m.mu.Lock()
		v.Backend, v.TTLSeconds = m.cfg.BackendName, int(m.cfg.TTL/time.Second)
		v.Registered, v.ReadAt = m.registered, m.readAt
		v.Reason = strings.Join(nonEmpty(m.regErr, m.readErr), "; ")
		v.Invalid = append([]string(nil), m.invalid...)
		members = members[:0]
		for _, mem := range m.members {
			if mem.Name == self.Name && v.Registered {
				// This node's own settings as they are now, not as
				// last announced.
				continue
			}
			members = append(members, mem)
		}
		m.mu.Unlock()
		if v.Registered || !hasMember(members, self.Name) {
			members = append(members, self)
		}
	} else {
		v.ReadAt = time.Now()
	}
	sort.Slice(members, func(i, j int) bool { return members[i].Name < members[j].Name })
	v.Drift = ComputeDrift(members)
	v.Drifted = len(v.Drift) > 0
	degraded := map[string]bool{}
	for _, d := range v.Drift {
		for _, n := range d.Drifting {
			degraded[n] = true
		}
	}
	for _, mem := range members {
		n := Node{Member: mem, Self: mem.Name == self.Name && (v.Registered || mem.Started.Equal(self.Started)), State: StateOK}
		if degraded[mem.Name] {
			n.State = StateDegraded
		}
		v.Nodes = append(v.Nodes, n)
	}
	if v.Drift == nil {
		v.Drift = []Drift{}
	}
	return v
}

// PeerAddrs returns the peer addresses (Member.Peer) of the other nodes as
// last read: where this node sends its prefill announcements.
func (m *Membership) PeerAddrs() []string {
	m.mu.Lock()
	defer m.mu.Unlock()
	var out []string
	for _, mem := range m.members {
		if mem.Name != m.cfg.Self.Name && mem.Peer != "" {
			out = append(out, mem.Peer)
		}
	}
	return out
}

func hasMember(ms []Member, name string) bool {
	for _, m := range ms {
		if m.Name == name {
			return true
		}
	}
	return false
}

func nonEmpty(s ...string) []string {
	var out []string
	for _, x := range s {
		if x != "" {
			out = append(out, x)
		}
	}
	return out
}

func (v View) selfNode() Node {
	for _, n := range v.Nodes {
		if n.Self {
			return n
		}
	}
	return Node{}
}

// Degraded reports whether this node drifts from the others, and the
// settings it drifts on, for the "cluster" capability.
func (v View) Degraded() (bool, string) {
	why := DriftOf(v.Self, v.Drift)
	if len(why) == 0 {
		return false, ""
	}
	return true, "this node's parity-relevant settings differ from other nodes' (requests hash or route differently depending on the node they reach): " +
		strings.Join(why, "; ")
}
