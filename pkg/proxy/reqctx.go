package proxy

import (
	"context"
	"slices"
	"sync"
	"time"
)

// reqCtx is the context one request's upstream work runs under: it carries
// the client connection's values and is cancelled when the client
// connection is gone (see trackedConn) or the request is over.
//
// It replaces context.WithCancelCause(context.WithoutCancel(r.Context()))
// plus a context.AfterFunc per upstream exchange, which together cost about
// eight allocations per request. A reqCtx is one allocation: its Done
// channel is made only if someone asks for it, and the upstream connection
// registers its canceller in a fixed slot (watchUpstream) instead of an
// AfterFunc. Contexts derived from it (context.WithTimeout and friends)
// and context.AfterFunc still work through its AfterFunc method.
type reqCtx struct {
	vals context.Context // the connection's values, never cancelled

	mu    sync.Mutex
	done  chan struct{} // made on first Done
	err   error
	up    func() // the upstream connection's canceller, see watchUpstream
	after []*afterEntry
}

type afterEntry struct{ f func() }

func (c *reqCtx) Deadline() (time.Time, bool) { return time.Time{}, false }
func (c *reqCtx) Value(k any) any             { return c.vals.Value(k) }

func (c *reqCtx) Done() <-chan struct{} {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.done == nil {
		c.done = make(chan struct{})
		if c.err != nil {
			close(c.done)
		}
	}
	return c.done
}

func (c *reqCtx) Err() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.err
}

// AfterFunc arranges for f to run in its own goroutine once c is
// cancelled, as context.AfterFunc does; the context package uses it for
// contexts derived from c.
func (c *reqCtx) AfterFunc(f func()) (stop func() bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.err != nil {
		go f()
		return func() bool { return false }
	}
	e := &afterEntry{f: f}
	c.after = append(c.after, e)
	return func() bool {
		c.mu.Lock()
		defer c.mu.Unlock()
		i := slices.Index(c.after, e)
		if i < 0 {
			return false
		}
		c.after = slices.Delete(c.after, i, i+1)
		return true
	}
}

// watchUpstream registers fn, which must not block, to run when c is
// cancelled; if c already is, fn runs at once. It reports false, and
// registers nothing, when the slot is taken (two exchanges under one
// request context at once): the caller then uses context.AfterFunc.
func (c *reqCtx) watchUpstream(fn func()) bool {
	c.mu.Lock()
	if c.up != nil {
		c.mu.Unlock()
		return false
	}
	if c.err != nil {
		c.mu.Unlock()
		fn()
		return true
	}
	c.up = fn
	c.mu.Unlock()
	return true
}

// unwatchUpstream empties the slot. It reports false if the canceller
// already ran (or is running): the connection's deadlines are poisoned.
func (c *reqCtx) unwatchUpstream() bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.err != nil {
		c.up = nil
		return false
	}
	c.up = nil
	return true
}

// cancel ends c: Done closes, Err says Canceled, the upstream canceller
// runs here and every AfterFunc in its own goroutine.
func (c *reqCtx) cancel() {
	c.mu.Lock()
	if c.err != nil {
		c.mu.Unlock()
		return
	}
	c.err = context.Canceled
	if c.done != nil {
		close(c.done)
	}
	up, after := c.up, c.after
	c.after = nil
	c.mu.Unlock()
	if up != nil {
		up()
	}
	for _, e := range after {
		go e.f()
	}
}

var _ context.Context = (*reqCtx)(nil)
