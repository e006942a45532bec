package proxy

import (
	"sync"
	"sync/atomic"
)

// InFlightTable counts the requests in flight per (service, endpoint
// index): the proxy's relays from connect to the end of the response, and
// the P/D legs carried by Request.Legs while they run. The proxy is its
// only writer; the router's load blend (the gateway) and the drain API
// read it.
//
// The daemon creates the table first and hands it to the proxy and to the
// gateway, so neither needs the other to exist: the proxy takes the
// gateway as its Picker, and the gateway reads loads without a reference
// to the proxy. It lives outside the proxy's rule table, so an Update
// that rebuilds a service keeps its counts: requests already in flight
// still finish against the same endpoints. Counters are never removed
// (one per endpoint a rule ever had).
//
// Both sides are on the request path, so the table is lock-free: a
// sync.Map of atomic counters, one lookup per read. The zero InFlightTable
// is empty and ready to use; it must not be copied.
type InFlightTable struct {
	m sync.Map // inflightKey -> *atomic.Int64
}

type inflightKey struct {
	service uint32
	ep      int
}

// Count returns how many requests are in flight to endpoint ep of service
// right now (connecting, waiting for headers or streaming).
func (t *InFlightTable) Count(service uint32, ep int) int {
	if v, ok := t.m.Load(inflightKey{service, ep}); ok {
		return int(v.(*atomic.Int64).Load())
	}
	return 0
}

// Counter returns the endpoint's counter, created on first use. Whoever
// sends a request adds 1 for as long as it is in flight and subtracts it
// when the request ends.
func (t *InFlightTable) Counter(service uint32, ep int) *atomic.Int64 {
	k := inflightKey{service, ep}
	if v, ok := t.m.Load(k); ok {
		return v.(*atomic.Int64)
	}
	v, _ := t.m.LoadOrStore(k, new(atomic.Int64))
	return v.(*atomic.Int64)
}
