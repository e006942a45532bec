//go:build linux

// Services: writing a rule's frontends, backends and selector generation
// into the maps, checking a rule before it is stored, and removing it.

package ebpf

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"time"

	"github.com/cilium/ebpf"
	"github.com/vishvananda/netlink"

	"github.com/loxilb-llm/loxilb/pkg/dataplane"
)

func (d *Dataplane) allocIdx() (uint16, bool) {
	for i, used := range d.idxUsed {
		if !used {
			d.idxUsed[i] = true
			return uint16(i), true
		}
	}
	return 0, false
}

// UpsertService implements dataplane.Dataplane.
func (d *Dataplane) UpsertService(ctx context.Context, svc dataplane.Service, eps []dataplane.Endpoint) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	if err := dataplane.Validate(svc, eps); err != nil {
		return err
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.closed {
		return dataplane.ErrClosed
	}
	proto, _ := dataplane.ProtoNumber(svc.Proto)
	keys, err := frontendKeys(svc, proto)
	if err != nil {
		return err
	}
	for _, k := range keys {
		id, ok := d.frontends[k]
		if !ok || id == svc.ID {
			continue
		}
		if other := d.services[id]; other != nil && other.recovered {
			// Left by a previous run and not held by this control plane,
			// which now gives the frontend to another service.
			d.removeStale(other, fmt.Sprintf("service %d takes its frontend %s:%d/%s", svc.ID, addrFrom(k.Vip), svc.Port, svc.Proto))
			continue
		}
		return fmt.Errorf("%w: service %d has %s:%d/%s", dataplane.ErrConflict, id, addrFrom(k.Vip), svc.Port, svc.Proto)
	}
	st := d.services[svc.ID]
	if st != nil && st.recovered && (st.svc.VIP != svc.VIP || st.svc.Port != svc.Port || st.svc.Proto != svc.Proto) {
		// The ID now names another service: the recovered one's slot,
		// flows and affinities must not pass to it.
		d.removeStale(st, fmt.Sprintf("its ID now names %s:%d/%s", svc.VIP, svc.Port, svc.Proto))
		st = nil
	}
	fresh := st == nil
	if !fresh && (st.svc.Mode == dataplane.ModeFullProxy) != (svc.Mode == dataplane.ModeFullProxy) {
		// The frontends move between the kernel path and proxy steering;
		// the same key may be in the other map.
		for _, k := range st.keys {
			d.removeFrontend(st, k)
		}
		st.keys = nil
	}
	if fresh {
		idx, ok := d.allocIdx()
		if !ok {
			return fmt.Errorf("%w: %d services", dataplane.ErrCapacity, dataplane.MaxServices)
		}
		st = &svcState{idx: idx, gen: 1}
		d.resetIndex(idx)
	}
	if err := d.install(st, svc, eps, keys, proto); err != nil {
		if fresh {
			d.idxUsed[st.idx] = false
		}
		return fmt.Errorf("install service %d: %w", svc.ID, err)
	}
	// Frontends the service no longer has (VIP, port or mode changed).
	for _, k := range st.keys {
		if !slices.Contains(keys, k) {
			d.removeFrontend(st, k)
		}
	}
	st.svc, st.eps, st.keys, st.recovered = svc, slices.Clone(eps), keys, false
	d.services[svc.ID] = st
	for _, k := range keys {
		d.frontends[k] = svc.ID
	}
	d.syncFilter()
	return nil
}

// CheckService implements dataplane.Checker: what UpsertService would
// refuse, found without changing anything.
func (d *Dataplane) CheckService(ctx context.Context, svc dataplane.Service, eps []dataplane.Endpoint) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	if err := dataplane.Validate(svc, eps); err != nil {
		return err
	}
	proto, _ := dataplane.ProtoNumber(svc.Proto)
	keys, err := frontendKeys(svc, proto)
	if err != nil {
		return err
	}
	if svc.Mode != dataplane.ModeFullProxy {
		for _, ep := range eps {
			if _, err := snatAddr(svc, ep); err != nil {
				return err
			}
		}
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.closed {
		return dataplane.ErrClosed
	}
	for _, k := range keys {
		id, ok := d.frontends[k]
		if !ok || (id == svc.ID && svc.ID != 0) {
			continue
		}
		if other := d.services[id]; other != nil && other.recovered {
			continue // a leftover of a previous run: the upsert removes it
		}
		return fmt.Errorf("%w: service %d has %s:%d/%s", dataplane.ErrConflict, id, addrFrom(k.Vip), svc.Port, svc.Proto)
	}
	if st := d.services[svc.ID]; st != nil && svc.ID != 0 {
		return nil // an update keeps its table index
	}
	for _, used := range d.idxUsed {
		if !used {
			return nil
		}
	}
	for _, st := range d.services {
		if st.recovered {
			return nil // PruneRecovered or an upsert frees it
		}
	}
	return fmt.Errorf("%w: %d services", dataplane.ErrCapacity, dataplane.MaxServices)
}

// frontendKeys lists the {vip, port, proto} keys of a service: one, or one
// per local IPv4 address for host one-arm (as loxilb replicates such rules).
func frontendKeys(svc dataplane.Service, proto uint8) ([]lbSvcKey, error) {
	if svc.Mode != dataplane.ModeHostOneArm {
		return []lbSvcKey{{Vip: nbo32(svc.VIP), Port: nbo16(svc.Port), Proto: proto}}, nil
	}
	addrs, err := netlink.AddrList(nil, netlink.FAMILY_V4)
	if err != nil {
		return nil, fmt.Errorf("list local addresses for host one-arm: %w", err)
	}
	var keys []lbSvcKey
	for _, a := range addrs {
		ip, ok := netip.AddrFromSlice(a.IP.To4())
		if !ok || ip.IsLoopback() {
			continue
		}
		keys = append(keys, lbSvcKey{Vip: nbo32(ip), Port: nbo16(svc.Port), Proto: proto})
	}
	return keys, nil
}

func (d *Dataplane) install(st *svcState, svc dataplane.Service, eps []dataplane.Endpoint, keys []lbSvcKey, proto uint8) error {
	if svc.Mode == dataplane.ModeFullProxy {
		slot, ok := d.proxySlots[svc.ProxyPort]
		if !ok {
			if len(d.proxySlots) >= 64 {
				return fmt.Errorf("%w: proxy listener ports", dataplane.ErrCapacity)
			}
			slot = uint32(len(d.proxySlots))
			d.proxySlots[svc.ProxyPort] = slot
		}
		if err := d.addLocalRoute(svc.VIP, svc.ID); err != nil {
			return err
		}
		for _, k := range keys {
			if err := d.objs.LbProxyVips.Put(k, lbProxyVal{SockIdx: slot, SvcId: svc.ID}); err != nil {
				return fmt.Errorf("write proxy VIP: %w", err)
			}
		}
		return nil
	}
	gen := st.gen ^ 1
	prev := st.cells
	if st.svc.Mode != svc.Mode {
		prev = nil // every flow of the old mode is stale: all cells afresh
	}
	cells, fresh, gone := assignCells(st.cells, prev, eps)
	bes := make([]lbBackend, len(eps))
	for i, ep := range eps {
		snat, err := snatAddr(svc, ep)
		if err != nil {
			return err
		}
		bes[i] = lbBackend{Addr: nbo32(ep.Addr), SnatAddr: snat, Port: nbo16(ep.Port), Cell: cells[epID{ep.Addr, ep.Port}]}
		if ep.Healthy {
			bes[i].Flags = beActive
		}
	}
	// New endpoints start on a clean cell before any flow can reach them.
	d.resetCells(st.idx, fresh)
	nslots, err := d.writeGeneration(st.idx, gen, svc.Sel, eps, bes)
	if err != nil {
		return err
	}
	persist := svc.PersistTimeout
	if persist == 0 {
		persist = dataplane.DefaultPersistTime
	}
	v := lbSvcVal{
		Id: svc.ID, Idx: st.idx, Mode: uint8(svc.Mode), Sel: uint8(svc.Sel), Gen: gen,
		SlotCount: uint16(nslots), EpCount: uint16(len(eps)),
		TimeoutS: uint32(dataplane.InactivityFor(svc) / time.Second), PersistS: uint32(persist / time.Second),
	}
	// Its frontends and endpoints pass the prefilter before the switch.
	var pending filterBitmap
	pending.addService(svc, eps, keys)
	if err := d.writeFilter(&pending); err != nil {
		return err
	}
	for _, k := range keys {
		if err := d.objs.LbServices.Put(k, v); err != nil {
			return fmt.Errorf("switch service entry: %w", err)
		}
	}
	st.gen = gen
	// Endpoints that left: their flows are stale from now on.
	d.resetCells(st.idx, gone)
	st.cells = cells
	return nil
}

// epID identifies an endpoint across updates of its service.
type epID struct {
	addr netip.Addr
	port uint16
}

// assignCells gives every endpoint of eps a counter/epoch cell: the one it
// has in keep, else a cell no endpoint of all (the previous assignment)
// used, else any cell the new set leaves free. fresh lists the newly
// assigned cells (to reset before the new endpoint set goes live), gone the
// cells of all that the new set no longer uses (to reset after).
func assignCells(all, keep map[epID]uint8, eps []dataplane.Endpoint) (cells map[epID]uint8, fresh, gone []uint8) {
	cells = make(map[epID]uint8, len(eps))
	var used, old [maxEPs]bool
	for _, c := range all {
		old[c] = true
	}
	for _, ep := range eps {
		id := epID{ep.Addr, ep.Port}
		if c, ok := keep[id]; ok {
			cells[id] = c
			used[c] = true
		}
	}
	for _, ep := range eps {
		id := epID{ep.Addr, ep.Port}
		if _, ok := cells[id]; ok {
			continue
		}
		c := -1
		for i := range maxEPs {
			if !used[i] && !old[i] {
				c = i
				break
			}
		}
		if c < 0 {
			for i := range maxEPs {
				if !used[i] {
					c = i
					break
				}
			}
		}
		if c < 0 {
			// More distinct endpoints than cells: Validate caps them.
			c = 0
		}
		cells[id] = uint8(c)
		used[c] = true
		fresh = append(fresh, uint8(c))
	}
	for c := range maxEPs {
		if old[c] && !used[c] {
			gone = append(gone, uint8(c))
		}
	}
	return cells, fresh, gone
}

// distinctCells reports whether no two endpoints share a cell.
func distinctCells(cells map[epID]uint8) bool {
	var seen [maxEPs]bool
	for _, c := range cells {
		if int(c) >= maxEPs || seen[c] {
			return false
		}
		seen[c] = true
	}
	return true
}

// writeGeneration fills the idle half of the endpoint and slot tables.
func (d *Dataplane) writeGeneration(idx uint16, gen uint8, sel int, eps []dataplane.Endpoint, bes []lbBackend) (int, error) {
	if len(bes) > 0 {
		keys := make([]uint32, len(bes))
		for i := range bes {
			keys[i] = beKey(idx, gen, i)
		}
		if _, err := d.objs.LbBackends.BatchUpdate(keys, bes, nil); err != nil {
			return 0, fmt.Errorf("write endpoints: %w", err)
		}
	}
	slots := buildSlots(sel, eps)
	if len(slots) > 0 {
		keys := make([]uint32, len(slots))
		base := (uint32(idx)*2 + uint32(gen)) * slotsPerGen
		for i := range slots {
			keys[i] = base + uint32(i)
		}
		if _, err := d.objs.LbSlots.BatchUpdate(keys, slots, nil); err != nil {
			return 0, fmt.Errorf("write slot table: %w", err)
		}
	}
	return len(slots), nil
}

func (d *Dataplane) removeFrontend(st *svcState, k lbSvcKey) {
	if err := d.objs.LbServices.Delete(k); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
		d.log.Warn("delete service entry", "id", st.svc.ID, "err", err)
	}
	if err := d.objs.LbProxyVips.Delete(k); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
		d.log.Warn("delete proxy VIP entry", "id", st.svc.ID, "err", err)
	}
	if st.svc.Mode == dataplane.ModeFullProxy {
		d.releaseLocalRoute(addrFrom(k.Vip), st.svc.ID)
	}
	delete(d.frontends, k)
}

// resetIndex zeroes the per-index state a previous service may have left
// and makes every flow of that service stale: every cell gets a new service
// generation (see lb_ep_epoch), so the previous service's entries are
// neither forwarded nor counted as the next one's.
func (d *Dataplane) resetIndex(idx uint16) {
	zero := make([]lbSvcStats, d.nCPU)
	if err := d.objs.LbSvcStats.Put(uint32(idx), zero); err != nil {
		d.log.Warn("reset service counters", "idx", idx, "err", err)
	}
	if err := d.objs.LbSvcGc.Put(uint32(idx), lbSvcGc{}); err != nil {
		d.log.Warn("reset service totals", "idx", idx, "err", err)
	}
	// A GC pass under way drops what it summed for this index.
	d.idxGen[idx]++
	d.objs.LbRrCursor.Put(uint32(idx), uint32(0))
	for c := range uint32(maxEPs) {
		d.bumpEpoch(uint32(idx)*maxEPs+c, true)
	}
}

// resetCells gives cells of service idx a new epoch and a zero count: the
// flows recorded with the old epoch are stale (dropped on their next packet
// or by the GC) and never decrement the count again. The service
// generation stays: those flows' counts are still the service's.
func (d *Dataplane) resetCells(idx uint16, cells []uint8) {
	for _, c := range cells {
		d.bumpEpoch(uint32(idx)*maxEPs+uint32(c), false)
	}
}

// bumpEpoch gives cell key a new epoch (and, with newService, a new
// service generation) and a zero least-connection count.
func (d *Dataplane) bumpEpoch(key uint32, newService bool) {
	var e uint32
	if err := d.objs.LbEpEpoch.Lookup(key, &e); err != nil {
		d.log.Warn("read endpoint epoch", "cell", key, "err", err)
	}
	if err := d.objs.LbEpEpoch.Put(key, nextEpoch(e, newService)); err != nil {
		d.log.Warn("bump endpoint epoch", "cell", key, "err", err)
	}
	if err := d.objs.LbActiveConns.Put(key, int64(0)); err != nil {
		d.log.Warn("reset connection count", "cell", key, "err", err)
	}
}

// nextEpoch is the epoch after e: the cell's half always moves (so a flow
// recorded with e is stale), the service generation (the high half) only
// when the index passes to another service.
func nextEpoch(e uint32, newService bool) uint32 {
	svc := e >> epochSvcShift
	if newService {
		svc++
	}
	return svc<<epochSvcShift | (e+1)&(1<<epochSvcShift-1)
}

// DeleteService implements dataplane.Dataplane.
func (d *Dataplane) DeleteService(ctx context.Context, id uint32) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.closed {
		return dataplane.ErrClosed
	}
	st, ok := d.services[id]
	if !ok {
		return nil
	}
	d.removeService(st)
	return nil
}

// removeService removes an installed service with its frontends, flows and
// affinities, and frees its index.
func (d *Dataplane) removeService(st *svcState) {
	for _, k := range st.keys {
		d.removeFrontend(st, k)
	}
	// Its flows go lazily: resetIndex makes them stale, and the program
	// (next packet) or the GC drops their entries.
	var ak lbAffinityKey
	var av lbAffinityVal
	var del []lbAffinityKey
	it := d.objs.LbAffinity.Iterate()
	for it.Next(&ak, &av) {
		if ak.SvcIdx == st.idx {
			del = append(del, ak)
		}
	}
	for _, k := range del {
		d.objs.LbAffinity.Delete(k)
	}
	d.resetIndex(st.idx)
	d.idxUsed[st.idx] = false
	delete(d.services, st.svc.ID)
	d.syncFilter()
}

// SetEndpointHealth implements dataplane.Dataplane. It rebuilds the slot
// table without (or with) the endpoint in the idle generation and flips.
// Established connections to an endpoint marked down keep their entries and
// drain.
func (d *Dataplane) SetEndpointHealth(ctx context.Context, id uint32, epIdx int, healthy bool) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.closed {
		return dataplane.ErrClosed
	}
	st, ok := d.services[id]
	if !ok {
		return fmt.Errorf("%w: %d", dataplane.ErrNotFound, id)
	}
	if epIdx < 0 || epIdx >= len(st.eps) {
		return fmt.Errorf("%w: service %d has no endpoint %d", dataplane.ErrInvalid, id, epIdx)
	}
	if st.eps[epIdx].Healthy == healthy {
		return nil
	}
	eps := slices.Clone(st.eps)
	eps[epIdx].Healthy = healthy
	proto, _ := dataplane.ProtoNumber(st.svc.Proto)
	if err := d.install(st, st.svc, eps, st.keys, proto); err != nil {
		return fmt.Errorf("service %d: set endpoint %d health: %w", id, epIdx, err)
	}
	st.eps = eps
	return nil
}
