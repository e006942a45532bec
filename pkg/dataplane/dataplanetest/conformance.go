package dataplanetest

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"sync"
	"testing"
	"time"

	"github.com/loxilb-llm/loxilb/pkg/dataplane"
)

// Factory returns a fresh, empty data plane for one subtest. The suite
// closes it; the factory may register further cleanup with t.Cleanup.
type Factory func(t *testing.T) dataplane.Dataplane

var (
	vip = netip.MustParseAddr("172.31.255.1")
	be1 = netip.MustParseAddr("172.31.254.1")
	be2 = netip.MustParseAddr("172.31.254.2")
)

func svc(id uint32, mode, sel int) dataplane.Service {
	return dataplane.Service{ID: id, VIP: vip, Port: uint16(8000 + id%1000), Proto: "tcp", Mode: mode, Sel: sel}
}

func twoEPs() []dataplane.Endpoint {
	return []dataplane.Endpoint{
		{Addr: be1, Port: 8080, Weight: 1, Healthy: true},
		{Addr: be2, Port: 8080, Weight: 1, Healthy: true},
	}
}

// RunConformance runs the conformance suite against the implementation
// produced by newDP. Endpoint addresses are never contacted: only the
// control surface is exercised.
func RunConformance(t *testing.T, newDP Factory) {
	ctx := context.Background()
	open := func(t *testing.T) dataplane.Dataplane {
		dp := newDP(t)
		t.Cleanup(func() { dp.Close() })
		return dp
	}
	mustStats := func(t *testing.T, dp dataplane.Dataplane) dataplane.Stats {
		t.Helper()
		st, err := dp.Stats(ctx)
		if err != nil {
			t.Fatalf("Stats: %v", err)
		}
		if st.Counters == nil || st.Services == nil {
			t.Fatalf("Stats maps must be non-nil: %+v", st)
		}
		return st
	}

	t.Run("UpsertShowsInStats", func(t *testing.T) {
		dp := open(t)
		if err := dp.UpsertService(ctx, svc(1, dataplane.ModeDNAT, dataplane.SelRoundRobin), twoEPs()); err != nil {
			t.Fatal(err)
		}
		if _, ok := mustStats(t, dp).Services[1]; !ok {
			t.Fatal("service 1 missing from Stats")
		}
	})

	t.Run("AllModesAndSelectors", func(t *testing.T) {
		dp := open(t)
		id := uint32(10)
		for _, mode := range []int{dataplane.ModeDNAT, dataplane.ModeOneArm, dataplane.ModeFullNAT} {
			for _, sel := range []int{dataplane.SelRoundRobin, dataplane.SelHash, dataplane.SelPriority, dataplane.SelPersist, dataplane.SelLeastConn, dataplane.SelConsistentHash} {
				s := svc(id, mode, sel)
				if mode == dataplane.ModeOneArm {
					s.SNATAddr = netip.MustParseAddr("172.31.253.1")
				}
				if err := dp.UpsertService(ctx, s, twoEPs()); err != nil {
					t.Fatalf("mode %d sel %d: %v", mode, sel, err)
				}
				id++
			}
		}
		dsr := svc(id, dataplane.ModeDSR, dataplane.SelHash)
		eps := twoEPs()
		eps[0].Port, eps[1].Port = dsr.Port, dsr.Port
		if err := dp.UpsertService(ctx, dsr, eps); err != nil {
			t.Fatalf("dsr: %v", err)
		}
		id++
		fp := svc(id, dataplane.ModeFullProxy, dataplane.SelRoundRobin)
		fp.ProxyPort = 15001
		if err := dp.UpsertService(ctx, fp, twoEPs()); err != nil {
			t.Fatalf("fullproxy: %v", err)
		}
		if got := len(mustStats(t, dp).Services); got != int(id-9) {
			t.Fatalf("Stats has %d services, want %d", got, id-9)
		}
	})

	t.Run("RejectsInvalid", func(t *testing.T) {
		dp := open(t)
		base := svc(2, dataplane.ModeDNAT, dataplane.SelRoundRobin)
		cases := []struct {
			name string
			mut  func(*dataplane.Service, *[]dataplane.Endpoint)
			want error
		}{
			{"proto", func(s *dataplane.Service, _ *[]dataplane.Endpoint) { s.Proto = "icmp" }, dataplane.ErrInvalid},
			{"ipv6 vip", func(s *dataplane.Service, _ *[]dataplane.Endpoint) { s.VIP = netip.MustParseAddr("2001:db8::1") }, dataplane.ErrInvalid},
			{"no vip", func(s *dataplane.Service, _ *[]dataplane.Endpoint) { s.VIP = netip.Addr{} }, dataplane.ErrInvalid},
			{"port 0", func(s *dataplane.Service, _ *[]dataplane.Endpoint) { s.Port = 0 }, dataplane.ErrInvalid},
			{"mode 9", func(s *dataplane.Service, _ *[]dataplane.Endpoint) { s.Mode = 9 }, dataplane.ErrInvalid},
			{"sel n3", func(s *dataplane.Service, _ *[]dataplane.Endpoint) { s.Sel = 6 }, dataplane.ErrUnsupported},
			{"hostonearm needs 0.0.0.0", func(s *dataplane.Service, _ *[]dataplane.Endpoint) { s.Mode = dataplane.ModeHostOneArm }, dataplane.ErrInvalid},
			{"0.0.0.0 for dnat", func(s *dataplane.Service, _ *[]dataplane.Endpoint) { s.VIP = netip.IPv4Unspecified() }, dataplane.ErrInvalid},
			{"dsr rr", func(s *dataplane.Service, _ *[]dataplane.Endpoint) { s.Mode = dataplane.ModeDSR }, dataplane.ErrInvalid},
			{"dsr port translation", func(s *dataplane.Service, _ *[]dataplane.Endpoint) {
				s.Mode, s.Sel = dataplane.ModeDSR, dataplane.SelHash
			}, dataplane.ErrInvalid},
			{"sctp dnat", func(s *dataplane.Service, _ *[]dataplane.Endpoint) { s.Proto = "sctp" }, dataplane.ErrUnsupported},
			{"fullproxy udp", func(s *dataplane.Service, _ *[]dataplane.Endpoint) {
				s.Mode, s.Proto, s.ProxyPort = dataplane.ModeFullProxy, "udp", 15001
			}, dataplane.ErrUnsupported},
			{"fullproxy no port", func(s *dataplane.Service, _ *[]dataplane.Endpoint) { s.Mode = dataplane.ModeFullProxy }, dataplane.ErrInvalid},
			{"negative timeout", func(s *dataplane.Service, _ *[]dataplane.Endpoint) { s.InactiveTimeout = -time.Second }, dataplane.ErrInvalid},
			{"endpoint addr", func(_ *dataplane.Service, e *[]dataplane.Endpoint) { (*e)[0].Addr = netip.Addr{} }, dataplane.ErrInvalid},
			{"endpoint port", func(_ *dataplane.Service, e *[]dataplane.Endpoint) { (*e)[1].Port = 0 }, dataplane.ErrInvalid},
			{"too many endpoints", func(_ *dataplane.Service, e *[]dataplane.Endpoint) {
				for i := range dataplane.MaxEndpoints {
					*e = append(*e, dataplane.Endpoint{Addr: netip.AddrFrom4([4]byte{172, 31, 250, byte(i + 1)}), Port: 80, Healthy: true})
				}
			}, dataplane.ErrCapacity},
		}
		for _, c := range cases {
			s, e := base, twoEPs()
			c.mut(&s, &e)
			err := dp.UpsertService(ctx, s, e)
			if !errors.Is(err, c.want) {
				t.Errorf("%s: got %v, want %v", c.name, err, c.want)
			}
		}
		if n := len(mustStats(t, dp).Services); n != 0 {
			t.Fatalf("rejected services were installed: %d", n)
		}
	})

	t.Run("ConflictAndMove", func(t *testing.T) {
		dp := open(t)
		a := svc(3, dataplane.ModeDNAT, dataplane.SelRoundRobin)
		if err := dp.UpsertService(ctx, a, twoEPs()); err != nil {
			t.Fatal(err)
		}
		b := a
		b.ID = 4
		if err := dp.UpsertService(ctx, b, twoEPs()); !errors.Is(err, dataplane.ErrConflict) {
			t.Fatalf("same frontend, other ID: got %v, want ErrConflict", err)
		}
		b.Proto = "udp" // different protocol: a different frontend
		if err := dp.UpsertService(ctx, b, twoEPs()); err != nil {
			t.Fatalf("udp twin: %v", err)
		}
		a.Port++ // service 3 moves; its old frontend becomes free
		if err := dp.UpsertService(ctx, a, twoEPs()); err != nil {
			t.Fatal(err)
		}
		c := svc(5, dataplane.ModeDNAT, dataplane.SelRoundRobin)
		c.Port = a.Port - 1
		if err := dp.UpsertService(ctx, c, twoEPs()); err != nil {
			t.Fatalf("freed frontend: %v", err)
		}
	})

	t.Run("UpdateInPlace", func(t *testing.T) {
		dp := open(t)
		s := svc(6, dataplane.ModeFullNAT, dataplane.SelHash)
		for i, eps := range [][]dataplane.Endpoint{twoEPs(), twoEPs()[:1], nil, twoEPs()} {
			if err := dp.UpsertService(ctx, s, eps); err != nil {
				t.Fatalf("update %d: %v", i, err)
			}
		}
		s.Sel = dataplane.SelConsistentHash
		s.InactiveTimeout = time.Minute
		if err := dp.UpsertService(ctx, s, twoEPs()); err != nil {
			t.Fatal(err)
		}
		if n := len(mustStats(t, dp).Services); n != 1 {
			t.Fatalf("%d services after updates, want 1", n)
		}
	})

	t.Run("Delete", func(t *testing.T) {
		dp := open(t)
		s := svc(7, dataplane.ModeDNAT, dataplane.SelRoundRobin)
		if err := dp.UpsertService(ctx, s, twoEPs()); err != nil {
			t.Fatal(err)
		}
		if err := dp.DeleteService(ctx, 7); err != nil {
			t.Fatal(err)
		}
		if _, ok := mustStats(t, dp).Services[7]; ok {
			t.Fatal("deleted service still in Stats")
		}
		if err := dp.DeleteService(ctx, 7); err != nil {
			t.Fatalf("second delete: %v (deletes are idempotent)", err)
		}
		if err := dp.DeleteService(ctx, 99); err != nil {
			t.Fatalf("delete unknown: %v", err)
		}
		s.ID = 8 // the frontend is free again
		if err := dp.UpsertService(ctx, s, twoEPs()); err != nil {
			t.Fatal(err)
		}
	})

	t.Run("EndpointHealth", func(t *testing.T) {
		dp := open(t)
		if err := dp.UpsertService(ctx, svc(9, dataplane.ModeDNAT, dataplane.SelRoundRobin), twoEPs()); err != nil {
			t.Fatal(err)
		}
		for _, step := range []struct {
			idx     int
			healthy bool
		}{{0, false}, {1, false}, {1, false}, {0, true}, {1, true}} {
			if err := dp.SetEndpointHealth(ctx, 9, step.idx, step.healthy); err != nil {
				t.Fatalf("ep %d healthy=%v: %v", step.idx, step.healthy, err)
			}
		}
		if err := dp.SetEndpointHealth(ctx, 9, 2, true); !errors.Is(err, dataplane.ErrInvalid) {
			t.Fatalf("bad index: got %v, want ErrInvalid", err)
		}
		if err := dp.SetEndpointHealth(ctx, 9, -1, true); !errors.Is(err, dataplane.ErrInvalid) {
			t.Fatalf("negative index: got %v, want ErrInvalid", err)
		}
		if err := dp.SetEndpointHealth(ctx, 77, 0, true); !errors.Is(err, dataplane.ErrNotFound) {
			t.Fatalf("unknown service: got %v, want ErrNotFound", err)
		}
	})

	t.Run("Capacity", func(t *testing.T) {
		dp := open(t)
		for i := range dataplane.MaxServices {
			s := svc(uint32(1000+i), dataplane.ModeDNAT, dataplane.SelRoundRobin)
			s.Port = uint16(20000 + i)
			if err := dp.UpsertService(ctx, s, twoEPs()[:1]); err != nil {
				t.Fatalf("service %d: %v", i, err)
			}
		}
		s := svc(5000, dataplane.ModeDNAT, dataplane.SelRoundRobin)
		s.Port = 30000
		if err := dp.UpsertService(ctx, s, twoEPs()); !errors.Is(err, dataplane.ErrCapacity) {
			t.Fatalf("service %d: got %v, want ErrCapacity", dataplane.MaxServices+1, err)
		}
		if err := dp.DeleteService(ctx, 1000); err != nil {
			t.Fatal(err)
		}
		if err := dp.UpsertService(ctx, s, twoEPs()); err != nil {
			t.Fatalf("after a delete: %v", err)
		}
	})

	t.Run("Concurrent", func(t *testing.T) {
		dp := open(t)
		var wg sync.WaitGroup
		errs := make(chan error, 64)
		for g := range 4 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for i := range 8 {
					id := uint32(g*100 + i + 1)
					s := svc(id, dataplane.ModeDNAT, dataplane.SelHash)
					s.Port = uint16(10000 + id)
					if err := dp.UpsertService(ctx, s, twoEPs()); err != nil {
						errs <- fmt.Errorf("upsert %d: %w", id, err)
					}
					if err := dp.SetEndpointHealth(ctx, id, 0, false); err != nil {
						errs <- fmt.Errorf("health %d: %w", id, err)
					}
					if _, err := dp.Stats(ctx); err != nil {
						errs <- err
					}
					if i%2 == 0 {
						if err := dp.DeleteService(ctx, id); err != nil {
							errs <- err
						}
					}
				}
			}()
		}
		wg.Wait()
		close(errs)
		for err := range errs {
			t.Error(err)
		}
		if n := len(mustStats(t, dp).Services); n != 16 {
			t.Fatalf("%d services, want 16", n)
		}
	})

	t.Run("ClosedRefuses", func(t *testing.T) {
		dp := newDP(t)
		if err := dp.Close(); err != nil {
			t.Fatal(err)
		}
		if err := dp.UpsertService(ctx, svc(1, 0, 0), twoEPs()); !errors.Is(err, dataplane.ErrClosed) {
			t.Fatalf("upsert after close: got %v, want ErrClosed", err)
		}
		if _, err := dp.Stats(ctx); !errors.Is(err, dataplane.ErrClosed) {
			t.Fatalf("stats after close: got %v, want ErrClosed", err)
		}
		if err := dp.Close(); err != nil {
			t.Fatalf("second close: %v", err)
		}
	})
}
