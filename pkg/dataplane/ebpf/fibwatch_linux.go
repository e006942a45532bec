//go:build linux

package ebpf

import (
	"errors"
	"fmt"
	"os"
	"sync"
	"syscall"

	"golang.org/x/sys/unix"
)

// fibWatch keeps the FIB results cached in conntrack entries honest: it
// listens to the kernel's routing notifications (IPv4 routes, rules,
// nexthops, addresses, links and IPv4 neighbours) in the data plane's
// network namespace and bumps lb_fib_gen after each batch of them, so the
// next packet of every flow asks the FIB again. A lost notification (the
// socket's buffer overran) bumps too. What no notification announces (a
// path-MTU exception), or what changes while no daemon runs, is bounded by
// the entries' lifetime in the program (FIB_TTL, about a second).
type fibWatch struct {
	d    *Dataplane
	f    *os.File
	done chan struct{}

	mu  sync.Mutex
	gen uint32
}

// rtnetlink multicast groups (RTNLGRP_*) the watch joins.
var fibGroups = []int{
	unix.RTNLGRP_LINK, unix.RTNLGRP_NEIGH, unix.RTNLGRP_IPV4_IFADDR,
	unix.RTNLGRP_IPV4_ROUTE, unix.RTNLGRP_IPV4_RULE, unix.RTNLGRP_NEXTHOP,
}

// startFIBWatch bumps the generation once (the daemon was not watching
// before: a pinned table may hold results from before a change) and starts
// watching.
func (d *Dataplane) startFIBWatch() error {
	fd, err := unix.Socket(unix.AF_NETLINK, unix.SOCK_RAW|unix.SOCK_CLOEXEC|unix.SOCK_NONBLOCK, unix.NETLINK_ROUTE)
	if err != nil {
		return fmt.Errorf("open routing notifications socket: %w", err)
	}
	if err := unix.Bind(fd, &unix.SockaddrNetlink{Family: unix.AF_NETLINK}); err != nil {
		unix.Close(fd)
		return fmt.Errorf("bind routing notifications socket: %w", err)
	}
	for _, g := range fibGroups {
		if err := unix.SetsockoptInt(fd, unix.SOL_NETLINK, unix.NETLINK_ADD_MEMBERSHIP, g); err != nil {
			unix.Close(fd)
			return fmt.Errorf("join routing notification group %d: %w", g, err)
		}
	}
	w := &fibWatch{d: d, f: os.NewFile(uintptr(fd), "rtnetlink"), done: make(chan struct{})}
	var cur uint32
	if err := d.objs.LbFibGen.Lookup(uint32(0), &cur); err != nil {
		w.f.Close()
		return fmt.Errorf("read FIB generation: %w", err)
	}
	w.gen = cur
	if err := w.bump(); err != nil {
		w.f.Close()
		return err
	}
	d.fib = w
	go w.run()
	return nil
}

// bump advances lb_fib_gen, skipping 0 (which marks an empty cache).
func (w *fibWatch) bump() error {
	w.mu.Lock()
	defer w.mu.Unlock()
	next := w.gen + 1
	if next == 0 {
		next = 1
	}
	if err := w.d.objs.LbFibGen.Put(uint32(0), next); err != nil {
		return fmt.Errorf("bump FIB generation: %w", err)
	}
	w.gen = next
	return nil
}

func (w *fibWatch) generation() uint32 {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.gen
}

func (w *fibWatch) run() {
	defer close(w.done)
	buf := make([]byte, 1<<16)
	for {
		n, err := w.f.Read(buf)
		switch {
		case errors.Is(err, os.ErrClosed):
			return
		case errors.Is(err, unix.ENOBUFS):
			// Notifications were lost: assume they changed the FIB.
		case err != nil:
			w.d.log.Warn("routing notifications: cached FIB results now live for their lifetime only", "err", err)
			return
		case !relevant(buf[:n]):
			continue
		}
		if err := w.bump(); err != nil {
			w.d.log.Warn("routing change not applied to cached FIB results", "err", err)
		}
	}
}

// relevant reports whether a batch of notifications may change an IPv4 FIB
// result: anything but IPv6 neighbour messages (the neighbour group carries
// both families).
func relevant(b []byte) bool {
	msgs, err := syscall.ParseNetlinkMessage(b)
	if err != nil {
		return true
	}
	for _, m := range msgs {
		switch m.Header.Type {
		case unix.RTM_NEWNEIGH, unix.RTM_DELNEIGH:
			if len(m.Data) > 0 && m.Data[0] == unix.AF_INET6 {
				continue
			}
		}
		return true
	}
	return false
}

// stop ends the watch.
func (w *fibWatch) stop() {
	w.f.Close()
	<-w.done
}

// FIBGeneration is the current value of lb_fib_gen: it moves on every
// routing or neighbour change the data plane has seen (tests wait on it).
func (d *Dataplane) FIBGeneration() uint32 {
	if d.fib == nil {
		return 0
	}
	return d.fib.generation()
}
