package peerprefill

import (
	"encoding/binary"
	"errors"
	"net"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/loxilb-llm/loxilb/testbed/wait"
)

func sampleLoads() []Load {
	return []Load{
		{Service: 3, EP: 2, EPHash: EndpointHash("127.0.0.1:8002"), InFlight: 5},
		{Service: 1, EP: 0, EPHash: EndpointHash("127.0.0.1:8000"), InFlight: 1},
		{Service: 3, EP: 0, EPHash: EndpointHash("127.0.0.1:8000"), InFlight: 0}, // idle: not sent
		{Service: 3, EP: 1, EPHash: EndpointHash("127.0.0.1:8001"), InFlight: MaxLoadInFlight},
	}
}

func TestLoadRoundTrip(t *testing.T) {
	ls, cut := normalizeLoads(sampleLoads())
	if cut != 0 || len(ls) != 3 || ls[0].Service != 1 || ls[1].EP != 1 || ls[2].EP != 2 {
		t.Fatalf("normalized %+v (cut %d)", ls, cut)
	}
	id := ID{Instance: 7, Seq: 11}
	d, err := decode(appendLoad(nil, id, ls), nil)
	if err != nil || d.kind != kindLoad || d.p.ID != id {
		t.Fatalf("decoded %+v, %v", d, err)
	}
	got, err := decodeLoads(d.body, nil)
	if err != nil || !slices.Equal(got, ls) {
		t.Fatalf("decoded %+v (%v), sent %+v", got, err, ls)
	}
	// An empty snapshot (nothing in flight) is a valid one.
	d, err = decode(appendLoad(nil, id, nil), nil)
	if got, err2 := decodeLoads(d.body, nil); err != nil || err2 != nil || len(got) != 0 {
		t.Fatalf("empty snapshot: %+v, %v, %v", got, err, err2)
	}
}

// Over MaxLoads loaded endpoints a snapshot keeps the most loaded, fits a
// datagram, and says how many it left out.
func TestLoadSnapshotIsBounded(t *testing.T) {
	var ls []Load
	for i := 0; i < MaxLoads+10; i++ {
		ls = append(ls, Load{Service: uint32(i), EP: 1, InFlight: i + 1})
	}
	ls, cut := normalizeLoads(ls)
	if cut != 10 || len(ls) != MaxLoads || ls[0].InFlight != 11 {
		t.Fatalf("cut %d, kept %d from %+v", cut, len(ls), ls[0])
	}
	if b := appendLoad(nil, ID{1, 1}, ls); len(b) > MaxDatagram {
		t.Fatalf("%d bytes over MaxDatagram %d", len(b), MaxDatagram)
	}
}

func TestDecodeLoadsRefusesMalformed(t *testing.T) {
	ls, _ := normalizeLoads(sampleLoads())
	good := appendLoad(nil, ID{1, 1}, ls)[headerLen:]
	mod := func(f func(b []byte) []byte) []byte { return f(slices.Clone(good)) }
	entry := func(i int) int { return 2 + loadEntryLen*i }
	cases := map[string][]byte{
		"empty":     nil,
		"one byte":  good[:1],
		"truncated": good[:len(good)-1],
		"trailing":  append(slices.Clone(good), 0),
		"too many":  mod(func(b []byte) []byte { binary.BigEndian.PutUint16(b, MaxLoads+1); return b }),
		"zero":      mod(func(b []byte) []byte { binary.BigEndian.PutUint16(b[entry(0)+14:], 0); return b }),
		"over the in-flight bound": mod(func(b []byte) []byte {
			binary.BigEndian.PutUint16(b[entry(0)+14:], MaxLoadInFlight+1)
			return b
		}),
		"out of order": mod(func(b []byte) []byte { binary.BigEndian.PutUint32(b[entry(1):], 9); return b }),
		"duplicate": mod(func(b []byte) []byte {
			copy(b[entry(2):entry(2)+6], b[entry(1):entry(1)+6])
			return b
		}),
	}
	for name, b := range cases {
		if _, err := decodeLoads(b, nil); !errors.Is(err, errMalformed) {
			t.Errorf("%s: err %v, want errMalformed", name, err)
		}
	}
}

func FuzzDecodeLoads(f *testing.F) {
	ls, _ := normalizeLoads(sampleLoads())
	f.Add(appendLoad(nil, ID{1, 2}, ls))
	f.Add(appendLoad(nil, ID{1, 3}, nil))
	f.Add(appendBegin(nil, samplePrefill()))
	f.Fuzz(func(t *testing.T, b []byte) {
		d, err := decode(b, nil)
		if err != nil || d.kind != kindLoad {
			return
		}
		got, err := decodeLoads(d.body, make([]Load, 0, MaxLoads))
		if err != nil {
			return
		}
		if len(got) > MaxLoads {
			t.Fatalf("accepted %d entries", len(got))
		}
		for i, l := range got {
			if l.InFlight < 1 || l.InFlight > MaxLoadInFlight || (i > 0 && loadOrder(got[i-1], l) >= 0) {
				t.Fatalf("accepted entry %d: %+v", i, got)
			}
		}
		// What decodes encodes back to the same bytes.
		if again := appendLoad(nil, d.p.ID, got); !slices.Equal(again, b) {
			t.Fatalf("re-encoded %x, read %x", again, b)
		}
	})
}

// loadHandler is a recorder that is also a LoadSource.
type loadHandler struct {
	*recorder
	mu sync.Mutex
	ls []Load
}

func (h *loadHandler) LocalLoad(dst []Load) []Load {
	h.mu.Lock()
	defer h.mu.Unlock()
	return append(dst, h.ls...)
}

func (h *loadHandler) set(ls ...Load) { h.mu.Lock(); h.ls = ls; h.mu.Unlock() }

// startLoadNode runs a node sharing its load every 2 ms, whose peers'
// snapshots expire after expiry.
func startLoadNode(t *testing.T, expiry time.Duration) (testNode, *loadHandler, func()) {
	h := &loadHandler{recorder: &recorder{}}
	tn, stop := startNodeWith(t, Config{LoadInterval: 2 * time.Millisecond, LoadExpiry: expiry}, h)
	return tn, h, stop
}

// Each node's in-flight counts reach the other, follow their changes,
// and stop counting once the sender is silent for LoadExpiry.
func TestPeerLoadExchangedAndExpires(t *testing.T) {
	// a repeats an unchanged snapshot every 50 ms, b holds one for 2 s.
	a, ah, stopA := startLoadNode(t, 200*time.Millisecond)
	b, _, _ := startLoadNode(t, 2*time.Second)
	h0 := EndpointHash("127.0.0.1:8000")
	if _, ok := b.n.PeerInFlight(1, 0, h0); ok {
		t.Fatal("peer load known with no peer")
	}
	if age := b.n.freshestLoadAge(time.Now()); age != -time.Second {
		t.Fatalf("freshest age %v with none held", age)
	}
	link(t, a, b)
	ah.set(Load{Service: 1, EP: 0, EPHash: h0, InFlight: 3})
	wait.Eventually(t, "a's 3 requests seen at b", func() bool { n, ok := b.n.PeerInFlight(1, 0, h0); return ok && n == 3 })
	if n, ok := b.n.PeerInFlight(1, 1, EndpointHash("127.0.0.1:8001")); !ok || n != 0 {
		t.Fatalf("an endpoint a does not name: %d, %v", n, ok)
	}
	if _, ok := b.n.PeerInFlight(1, 0, EndpointHash("127.0.0.1:9999")); ok {
		t.Fatal("a's count taken for an endpoint that is another address here")
	}
	if age := b.n.freshestLoadAge(time.Now()); age < 0 || age > time.Hour {
		t.Fatalf("freshest age %v", age)
	}
	ah.set()
	wait.Eventually(t, "a's requests ended at b", func() bool { n, ok := b.n.PeerInFlight(1, 0, h0); return ok && n == 0 })
	if testutil.ToFloat64(a.n.load.sent) < 2 || testutil.ToFloat64(b.n.load.received) < 2 {
		t.Fatal("sent/received not counted")
	}
	ah.set(Load{Service: 1, EP: 0, EPHash: h0, InFlight: 2})
	wait.Eventually(t, "a's 2 requests seen at b", func() bool { n, ok := b.n.PeerInFlight(1, 0, h0); return ok && n == 2 })
	stopA()
	wait.Eventually(t, "a's silent snapshot expired at b", func() bool { _, ok := b.n.PeerInFlight(1, 0, h0); return !ok })
}

// A snapshot older than the one held (reordered datagrams) does not undo
// it; a restarted peer (another instance) starts its own sequence.
func TestPeerLoadStaleIsRejected(t *testing.T) {
	a, b := startNode(t), startNode(t)
	b.n.cfg.LoadInterval = time.Second // uses peer load; sends none (no LoadSource)
	link(t, a, b)
	from, h0 := a.n.Addr(), EndpointHash("x")
	body := func(n int) []byte {
		return appendLoad(nil, ID{1, 1}, []Load{{Service: 1, EP: 0, EPHash: h0, InFlight: n}})[headerLen:]
	}
	now := time.Now()
	if why := b.n.takeLoad(from, ID{5, 10}, body(4), nil, now); why != "" {
		t.Fatal(why)
	}
	if why := b.n.takeLoad(from, ID{5, 9}, body(1), nil, now); why != LoadRejectStale {
		t.Fatalf("older snapshot: %q", why)
	}
	if n, _ := b.n.PeerInFlight(1, 0, h0); n != 4 {
		t.Fatalf("in flight %d after a stale snapshot, want 4", n)
	}
	if why := b.n.takeLoad(from, ID{6, 1}, body(1), nil, now); why != "" {
		t.Fatalf("restarted peer: %q", why)
	}
	if n, _ := b.n.PeerInFlight(1, 0, h0); n != 1 {
		t.Fatalf("in flight %d after the restarted peer's snapshot, want 1", n)
	}
	// A peer that leaves takes its load with it.
	b.peers.set()
	b.n.refresh()
	b.n.load.mu.RLock()
	held := len(b.n.load.peers)
	b.n.load.mu.RUnlock()
	if held != 0 {
		t.Fatalf("%d snapshots held of peers that left", held)
	}
}

// Load datagrams from a stranger or malformed ones are counted as
// rejected and never counted as load.
func TestHostileLoadIsRejected(t *testing.T) {
	a, _, _ := startLoadNode(t, time.Hour)
	b, _, _ := startLoadNode(t, time.Hour)
	link(t, a, b)
	rejected := func(reason string) float64 { return testutil.ToFloat64(b.n.load.rejected.WithLabelValues(reason)) }
	h0 := EndpointHash("x")
	huge := appendLoad(nil, ID{a.n.instance, 1 << 40}, []Load{{Service: 1, EP: 0, EPHash: h0, InFlight: 1}})
	binary.BigEndian.PutUint16(huge[headerLen+2+14:], 60000)

	stranger, err := net.ListenUDP("udp", &net.UDPAddr{IP: net.IPv4(127, 0, 0, 1)})
	if err != nil {
		t.Fatal(err)
	}
	defer stranger.Close()
	if _, err := stranger.WriteToUDPAddrPort(appendLoad(nil, ID{1, 1}, []Load{{Service: 1, EP: 0, EPHash: h0, InFlight: 9}}), b.n.Addr()); err != nil {
		t.Fatal(err)
	}
	if _, err := a.n.conn.WriteToUDPAddrPort(huge, b.n.Addr()); err != nil {
		t.Fatal(err)
	}
	wait.Eventually(t, "both rejected", func() bool {
		return rejected(LoadRejectUnknownPeer) == 1 && rejected(LoadRejectMalformed) == 1
	})
	// a's own (empty) snapshots are still taken.
	wait.Eventually(t, "a's load known at b", func() bool { n, ok := b.n.PeerInFlight(1, 0, h0); return ok && n == 0 })
}
