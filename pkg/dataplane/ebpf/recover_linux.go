//go:build linux

// Recovery after a restart: pinned maps are reused when their layout still
// matches, and services the rule store does not hold are removed.

package ebpf

import (
	"context"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"time"

	"github.com/cilium/ebpf"

	"github.com/loxilb-llm/loxilb/pkg/dataplane"
)

// dropIncompatiblePins removes pinned maps whose layout differs from this
// build's (left by an older version), so they are created afresh instead of
// failing the start. Their state is lost: for conntrack that ends the flows
// they held; services are re-installed by the control plane.
func (d *Dataplane) dropIncompatiblePins(spec *ebpf.CollectionSpec) {
	for name, ms := range spec.Maps {
		if ms.Pinning != ebpf.PinByName {
			continue
		}
		path := filepath.Join(d.cfg.PinPath, name)
		m, err := ebpf.LoadPinnedMap(path, nil)
		if err != nil {
			continue // not pinned yet
		}
		err = ms.Compatible(m)
		m.Close()
		if err == nil {
			continue
		}
		if rmErr := os.Remove(path); rmErr != nil {
			d.log.Error("remove an incompatible pinned map", "map", name, "pin", path, "err", rmErr)
			continue
		}
		d.log.Warn("pinned map has the layout of another version: recreated empty", "map", name, "pin", path, "diff", err.Error())
	}
}

// recover rebuilds the Go view of services from pinned maps after a restart,
// so IDs keep their table index (conntrack entries refer to it).
func (d *Dataplane) recover() error {
	var k lbSvcKey
	var v lbSvcVal
	it := d.objs.LbServices.Iterate()
	for it.Next(&k, &v) {
		st := d.services[v.Id]
		if st == nil {
			st = &svcState{idx: v.Idx, gen: v.Gen, recovered: true, svc: dataplane.Service{
				ID: v.Id, VIP: addrFrom(k.Vip), Port: hostPort(k.Port), Proto: protoName(k.Proto),
				Mode: int(v.Mode), Sel: int(v.Sel), InactiveTimeout: time.Duration(v.TimeoutS) * time.Second,
				PersistTimeout: time.Duration(v.PersistS) * time.Second,
			}}
			for i := range int(v.EpCount) {
				var be lbBackend
				if err := d.objs.LbBackends.Lookup(beKey(v.Idx, v.Gen, i), &be); err != nil {
					return fmt.Errorf("recover endpoints of service %d: %w", v.Id, err)
				}
				e := dataplane.Endpoint{Addr: addrFrom(be.Addr), Port: hostPort(be.Port), Weight: 1, Healthy: be.Flags&beActive != 0}
				st.eps = append(st.eps, e)
				if st.cells == nil {
					st.cells = map[epID]uint8{}
				}
				st.cells[epID{e.Addr, e.Port}] = be.Cell
			}
			if !distinctCells(st.cells) {
				// Written by a version without cells: the next update
				// assigns them afresh.
				st.cells = nil
			}
			if int(v.Idx) >= dataplane.MaxServices {
				return fmt.Errorf("recover service %d: index %d out of range", v.Id, v.Idx)
			}
			d.idxUsed[v.Idx] = true
			d.services[v.Id] = st
		}
		if st.svc.Mode == dataplane.ModeHostOneArm {
			st.svc.VIP = netip.IPv4Unspecified()
		}
		st.keys = append(st.keys, k)
		d.frontends[k] = v.Id
	}
	if err := it.Err(); err != nil {
		return fmt.Errorf("recover services: %w", err)
	}
	var pv lbProxyVal
	pit := d.objs.LbProxyVips.Iterate()
	for pit.Next(&k, &pv) {
		if _, ok := d.services[pv.SvcId]; ok {
			continue
		}
		idx, ok := d.allocIdx()
		if !ok {
			return fmt.Errorf("recover proxy service %d: %w", pv.SvcId, dataplane.ErrCapacity)
		}
		d.services[pv.SvcId] = &svcState{idx: idx, keys: []lbSvcKey{k}, recovered: true, svc: dataplane.Service{
			ID: pv.SvcId, VIP: addrFrom(k.Vip), Port: hostPort(k.Port), Proto: "tcp", Mode: dataplane.ModeFullProxy,
		}}
		d.frontends[k] = pv.SvcId
	}
	if err := pit.Err(); err != nil {
		return fmt.Errorf("recover proxy services: %w", err)
	}
	if d.cfg.PinPath != "" {
		if err := d.recoverRoutes(); err != nil {
			return err
		}
	}
	if err := d.writeFilter(nil); err != nil {
		return err
	}
	if len(d.services) > 0 {
		d.log.Info("recovered services from pinned maps", "count", len(d.services), "pin_path", d.cfg.PinPath)
	}
	return nil
}

// removeStale removes a recovered service the control plane does not hold,
// says so and counts it.
func (d *Dataplane) removeStale(st *svcState, why string) {
	d.log.Warn("removing a service left in the pinned maps by a previous run: the rule store does not hold it",
		"id", st.svc.ID, "vip", st.svc.VIP, "port", st.svc.Port, "proto", st.svc.Proto, "mode", st.svc.Mode, "why", why)
	d.removeService(st)
	d.staleRemoved++
}

// PruneRecovered implements dataplane.Recoverer.
func (d *Dataplane) PruneRecovered(ctx context.Context) ([]uint32, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.closed {
		return nil, dataplane.ErrClosed
	}
	var ids []uint32
	for id, st := range d.services {
		if st.recovered {
			ids = append(ids, id)
		}
	}
	slices.Sort(ids)
	for _, id := range ids {
		d.removeStale(d.services[id], "not installed by the control plane after the restart")
	}
	return ids, nil
}

// StaleServicesRemoved is how many services recovered from the pinned maps
// were removed because the control plane does not hold them.
func (d *Dataplane) StaleServicesRemoved() uint64 {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.staleRemoved
}
