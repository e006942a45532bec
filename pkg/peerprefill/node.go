package peerprefill

import (
	"context"
	"crypto/rand"
	"encoding/binary"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/netip"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// Handler is the receiving side: the gateway's coalescer.
type Handler interface {
	// RemoteBegin takes an announcement from the peer at from. It returns
	// "" when it keeps it, else the drop reason (DropRule, DropFull). p.Keys
	// is reused after the call: a handler copies what it keeps.
	RemoteBegin(from netip.Addr, p Prefill) string
	// RemoteDone ends announcement id if it is still held.
	RemoteDone(id ID)
}

// Config configures a Node.
type Config struct {
	// Listen is the UDP address the node receives on ("127.0.0.1:0",
	// ":7946").
	Listen string
	// Peers returns the other nodes' peer addresses (host:port) as the
	// membership last read them; called every Refresh.
	Peers func() []string
	// Refresh is how often Peers is read again. Default 1s (the
	// membership's own refresh).
	Refresh time.Duration
	// LoadInterval is how often this node's load snapshot is read from
	// the Handler (a LoadSource) and sent when it changed (load.go); 0:
	// no load is shared, sent or used.
	LoadInterval time.Duration
	// LoadExpiry is how long a peer's snapshot counts; default
	// DefaultLoadExpiry.
	LoadExpiry time.Duration
}

// maxPeers bounds the peers a node sends to (and accepts from).
const maxPeers = 64

// Node sends this node's prefill announcements to the other nodes and
// hands theirs to the Handler its Run serves. It is built before the
// gateway, which announces through it from its construction on; the
// gateway, built with it, is the Handler given to Run.
type Node struct {
	cfg      Config
	log      *slog.Logger
	conn     *net.UDPConn
	instance uint64
	seq      atomic.Uint64
	peers    atomic.Pointer[peerSet]
	bufs     sync.Pool

	// heard is the instance each peer address last sent from (guarded by
	// heardMu, written by the receiver); outranked is whether some peer
	// of the current set was not heard yet or has a lower instance.
	heardMu   sync.Mutex
	heard     map[netip.AddrPort]uint64
	outranked atomic.Bool

	sent, received *prometheus.CounterVec
	dropped        *prometheus.CounterVec
	sendErrors     prometheus.Counter

	load loadState
}

// peerSet is the peers' addresses, which are also the only source
// addresses accepted: a node sends from the socket it receives on.
type peerSet struct {
	addrs []netip.AddrPort
	from  map[netip.AddrPort]bool
}

// New binds the node's socket and registers its metrics on reg (nil: none).
func New(cfg Config, logger *slog.Logger, reg prometheus.Registerer) (*Node, error) {
	if cfg.Peers == nil {
		return nil, errors.New("peerprefill: a peer source is required")
	}
	if cfg.Refresh <= 0 {
		cfg.Refresh = time.Second
	}
	if cfg.LoadExpiry <= 0 {
		cfg.LoadExpiry = DefaultLoadExpiry
	}
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}
	ua, err := net.ResolveUDPAddr("udp", cfg.Listen)
	if err != nil {
		return nil, fmt.Errorf("peerprefill: listen address %q: %w", cfg.Listen, err)
	}
	conn, err := net.ListenUDP("udp", ua)
	if err != nil {
		return nil, fmt.Errorf("peerprefill: %w", err)
	}
	var rb [8]byte
	_, _ = rand.Read(rb[:])
	// Never 0: receivers read instance 0 as none (malformed).
	n := &Node{cfg: cfg, log: logger, conn: conn, instance: max(binary.BigEndian.Uint64(rb[:]), 1),
		sent: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "loxilb_cluster_prefill_sent_total",
			Help: "Prefill announcements sent to the other gateway nodes, by kind (begin, done), one per peer."}, []string{"kind"}),
		received: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "loxilb_cluster_prefill_received_total",
			Help: "Prefill announcements from the other gateway nodes taken, by kind (begin, done)."}, []string{"kind"}),
		dropped: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "loxilb_cluster_prefill_dropped_total",
			Help: "Datagrams on the prefill announcement port dropped, by reason (unknown_peer, malformed, rule, full)."}, []string{"reason"}),
		sendErrors: prometheus.NewCounter(prometheus.CounterOpts{Name: "loxilb_cluster_prefill_send_errors_total",
			Help: "Datagrams (prefill announcements, load snapshots) that could not be sent to a peer."}),
		load: newLoadState(),
	}
	n.peers.Store(&peerSet{})
	n.heard = map[netip.AddrPort]uint64{}
	n.bufs.New = func() any { b := make([]byte, 0, MaxDatagram); return &b }
	if reg != nil {
		peers := prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "loxilb_cluster_prefill_peers",
			Help: "Other gateway nodes this node sends its prefill announcements to."},
			func() float64 { return float64(n.Peers()) })
		for _, c := range append([]prometheus.Collector{n.sent, n.received, n.dropped, n.sendErrors, peers}, n.loadCollectors()...) {
			if err := reg.Register(c); err != nil {
				_ = conn.Close()
				return nil, fmt.Errorf("peerprefill metrics: %w", err)
			}
		}
	}
	return n, nil
}

// Addr is the bound UDP address.
func (n *Node) Addr() netip.AddrPort { return n.conn.LocalAddr().(*net.UDPAddr).AddrPort() }

// Instance is the random number naming this process in its
// announcements (ID.Instance); receivers rank crossing leaders by it.
func (n *Node) Instance() uint64 { return n.instance }

// Outranked reports whether a peer may rank before this node (a lower
// instance), so that this node's new leaders should wait for its
// announcements: true while some current peer has not been heard from,
// false with no peer. A peer restarted with a lower instance is seen
// at its first datagram.
func (n *Node) Outranked() bool { return n.outranked.Load() }

// hear records the instance a peer sent from.
func (n *Node) hear(from netip.AddrPort, instance uint64) {
	n.heardMu.Lock()
	defer n.heardMu.Unlock()
	if n.heard[from] == instance {
		return
	}
	n.heard[from] = instance
	n.rankLocked(n.peers.Load())
}

// rankLocked sets outranked for peer set ps and forgets the instances of
// addresses that left it (heardMu held).
func (n *Node) rankLocked(ps *peerSet) {
	out := false
	for a, in := range n.heard {
		if !ps.from[a] {
			delete(n.heard, a)
		} else if in < n.instance {
			out = true
		}
	}
	n.outranked.Store(out || len(n.heard) < len(ps.addrs))
}

// Peers is how many peers the node sends to now.
func (n *Node) Peers() int { return len(n.peers.Load().addrs) }

// Run receives datagrams, handing the other nodes' announcements to h, and
// refreshes the peers until ctx ends; it closes the socket on return.
// Nothing is sent before Run has read the peers once, and nothing is
// received outside it, so h needs no link to the node made afterwards.
func (n *Node) Run(ctx context.Context, h Handler) error {
	if h == nil {
		_ = n.conn.Close()
		return errors.New("peerprefill: Run needs a handler")
	}
	n.refresh()
	var wg sync.WaitGroup
	if src, ok := h.(LoadSource); ok && n.cfg.LoadInterval > 0 {
		wg.Go(func() { n.shareLoad(ctx, src) })
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		t := time.NewTicker(n.cfg.Refresh)
		defer t.Stop()
		for {
			select {
			case <-ctx.Done():
				_ = n.conn.Close()
				return
			case <-t.C:
				n.refresh()
			}
		}
	}()
	n.receive(h)
	<-done
	wg.Wait()
	return nil
}

// refresh resolves the peers' addresses; an address that does not resolve
// is left out until it does.
func (n *Node) refresh() {
	ps := &peerSet{from: map[netip.AddrPort]bool{}}
	self := n.Addr()
	for _, s := range n.cfg.Peers() {
		if len(ps.addrs) == maxPeers {
			break
		}
		ua, err := net.ResolveUDPAddr("udp", s)
		if err != nil {
			n.log.Debug("peerprefill: peer address does not resolve", "peer", s, "err", err)
			continue
		}
		ap := ua.AddrPort()
		ap = netip.AddrPortFrom(ap.Addr().Unmap(), ap.Port())
		if ap == self || ap.Port() == 0 {
			continue
		}
		if ps.from[ap] {
			continue
		}
		ps.addrs = append(ps.addrs, ap)
		ps.from[ap] = true
	}
	n.heardMu.Lock()
	n.peers.Store(ps)
	n.rankLocked(ps)
	n.heardMu.Unlock()
	n.forgetLoads(ps)
}

// receive reads datagrams until the socket is closed.
func (n *Node) receive(h Handler) {
	buf := make([]byte, MaxDatagram+1) // one more: a longer datagram is seen as such
	keys := make([]uint64, 0, MaxKeys)
	loads := make([]Load, 0, MaxLoads)
	for {
		sz, from, err := n.conn.ReadFromUDPAddrPort(buf)
		if err != nil {
			if errors.Is(err, net.ErrClosed) {
				return
			}
			continue
		}
		n.handle(h, buf[:sz], netip.AddrPortFrom(from.Addr().Unmap(), from.Port()), keys, loads)
	}
}

// handle checks and hands over one datagram (keys and loads are the
// receiver's scratch buffers).
func (n *Node) handle(h Handler, b []byte, from netip.AddrPort, keys []uint64, loads []Load) {
	drop := func(why string) {
		n.dropped.WithLabelValues(why).Inc()
		if isLoad(b) {
			n.load.rejected.WithLabelValues(why).Inc()
		}
	}
	if !n.peers.Load().from[from] {
		drop(DropUnknownPeer)
		return
	}
	if len(b) > MaxDatagram {
		drop(DropMalformed)
		return
	}
	d, err := decode(b, keys)
	if err != nil {
		drop(DropMalformed)
		return
	}
	if d.kind == kindLoad {
		switch why := n.takeLoad(from, d.p.ID, d.body, loads, time.Now()); why {
		case "":
			n.load.received.Inc()
		case LoadRejectMalformed:
			drop(why)
			return
		default:
			n.load.rejected.WithLabelValues(why).Inc()
		}
		n.hear(from, d.p.ID.Instance)
		return
	}
	n.hear(from, d.p.ID.Instance)
	if d.kind == kindDone {
		n.received.WithLabelValues("done").Inc()
		h.RemoteDone(d.p.ID)
		return
	}
	if why := h.RemoteBegin(from.Addr(), d.p); why != "" {
		n.dropped.WithLabelValues(why).Inc()
		return
	}
	n.received.WithLabelValues("begin").Inc()
}

// Announce tells every peer that p's keys are in prefill (p.ID is
// assigned here) and returns the function that tells them it is done
// (to call at the request's first byte, or when it fails; later calls do
// nothing). With no peer it sends nothing and returns a no-op.
func (n *Node) Announce(p Prefill) func() {
	ps := n.peers.Load()
	if len(ps.addrs) == 0 || len(p.Keys) == 0 {
		return func() {}
	}
	p.ID = ID{Instance: n.instance, Seq: n.seq.Add(1)}
	n.send(ps, "begin", func(b []byte) []byte { return appendBegin(b, p) })
	var once sync.Once
	return func() {
		once.Do(func() { n.send(n.peers.Load(), "done", func(b []byte) []byte { return appendDone(b, p.ID) }) })
	}
}

func (n *Node) send(ps *peerSet, kind string, enc func([]byte) []byte) {
	bp := n.bufs.Get().(*[]byte)
	b := enc((*bp)[:0])
	for _, a := range ps.addrs {
		if _, err := n.conn.WriteToUDPAddrPort(b, a); err != nil {
			n.sendErrors.Inc()
			continue
		}
		n.sent.WithLabelValues(kind).Inc()
	}
	*bp = b[:0]
	n.bufs.Put(bp)
}
