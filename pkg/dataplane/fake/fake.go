// Package fake is an in-memory dataplane.Dataplane for control-plane tests.
// It validates exactly like the eBPF implementation and records the desired
// state so tests can inspect what the control plane installed. It forwards
// no packets, so its counters stay at zero.
package fake

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"syscall"

	"github.com/loxilb-llm/loxilb/pkg/dataplane"
)

type entry struct {
	svc dataplane.Service
	eps []dataplane.Endpoint
}

type frontend struct {
	vip   string
	port  uint16
	proto string
}

// Dataplane is the in-memory data plane. The zero value is not usable; call New.
type Dataplane struct {
	mu        sync.Mutex
	closed    bool
	services  map[uint32]*entry
	listeners map[uint16]syscall.Conn
}

var (
	_ dataplane.Checker      = (*Dataplane)(nil)
	_ dataplane.Dataplane    = (*Dataplane)(nil)
	_ dataplane.ProxySteerer = (*Dataplane)(nil)
)

// New returns an empty fake data plane.
func New() *Dataplane {
	return &Dataplane{services: map[uint32]*entry{}, listeners: map[uint16]syscall.Conn{}}
}

func key(s dataplane.Service) frontend {
	return frontend{s.VIP.String(), s.Port, s.Proto}
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
	if err := d.checkLocked(svc); err != nil {
		return err
	}
	d.services[svc.ID] = &entry{svc: svc, eps: slices.Clone(eps)}
	return nil
}

// CheckService implements dataplane.Checker.
func (d *Dataplane) CheckService(ctx context.Context, svc dataplane.Service, eps []dataplane.Endpoint) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	if err := dataplane.Validate(svc, eps); err != nil {
		return err
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.checkLocked(svc)
}

func (d *Dataplane) checkLocked(svc dataplane.Service) error {
	if d.closed {
		return dataplane.ErrClosed
	}
	for id, e := range d.services {
		if id != svc.ID && key(e.svc) == key(svc) {
			return fmt.Errorf("%w: service %d has %s:%d/%s", dataplane.ErrConflict, id, svc.VIP, svc.Port, svc.Proto)
		}
	}
	if _, ok := d.services[svc.ID]; (!ok || svc.ID == 0) && len(d.services) >= dataplane.MaxServices {
		return fmt.Errorf("%w: %d services", dataplane.ErrCapacity, len(d.services))
	}
	return nil
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
	delete(d.services, id)
	return nil
}

// SetEndpointHealth implements dataplane.Dataplane.
func (d *Dataplane) SetEndpointHealth(ctx context.Context, id uint32, epIdx int, healthy bool) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.closed {
		return dataplane.ErrClosed
	}
	e, ok := d.services[id]
	if !ok {
		return fmt.Errorf("%w: %d", dataplane.ErrNotFound, id)
	}
	if epIdx < 0 || epIdx >= len(e.eps) {
		return fmt.Errorf("%w: service %d has no endpoint %d", dataplane.ErrInvalid, id, epIdx)
	}
	e.eps[epIdx].Healthy = healthy
	return nil
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
	st := dataplane.Stats{Counters: map[string]uint64{}, Services: map[uint32]dataplane.ServiceStats{}}
	for id := range d.services {
		st.Services[id] = dataplane.ServiceStats{}
	}
	return st, nil
}

// RegisterProxyListener implements dataplane.ProxySteerer by recording l.
func (d *Dataplane) RegisterProxyListener(port uint16, l syscall.Conn) error {
	if port == 0 || l == nil {
		return fmt.Errorf("%w: proxy listener needs a port and a socket", dataplane.ErrInvalid)
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.closed {
		return dataplane.ErrClosed
	}
	d.listeners[port] = l
	return nil
}

// Close implements dataplane.Dataplane.
func (d *Dataplane) Close() error {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.closed = true
	return nil
}

// Service returns what is installed for id, for test assertions.
func (d *Dataplane) Service(id uint32) (dataplane.Service, []dataplane.Endpoint, bool) {
	d.mu.Lock()
	defer d.mu.Unlock()
	e, ok := d.services[id]
	if !ok {
		return dataplane.Service{}, nil, false
	}
	return e.svc, slices.Clone(e.eps), true
}
