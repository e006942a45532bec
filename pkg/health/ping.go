package health

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/net/icmp"
	"golang.org/x/net/ipv4"
	"golang.org/x/net/ipv6"
)

// ErrPingUnavailable means the process can open neither an unprivileged
// ICMP ping socket nor a raw ICMP socket.
var ErrPingUnavailable = errors.New("ICMP ping unavailable: allow the process's group in net.ipv4.ping_group_range (sysctl) or run with CAP_NET_RAW")

// pinger sends ICMP echo requests. The zero value is ready; it remembers
// which socket kind works so later probes skip the failing one.
type pinger struct {
	seq  atomic.Uint32
	mu   sync.Mutex
	kind map[bool]string // ipv6? -> working network name
}

func (pg *pinger) networks(v6 bool) []string {
	pg.mu.Lock()
	defer pg.mu.Unlock()
	if n, ok := pg.kind[v6]; ok {
		return []string{n}
	}
	if v6 {
		return []string{"udp6", "ip6:ipv6-icmp"}
	}
	return []string{"udp4", "ip4:icmp"}
}

func (pg *pinger) remember(v6 bool, network string) {
	pg.mu.Lock()
	defer pg.mu.Unlock()
	if pg.kind == nil {
		pg.kind = make(map[bool]string)
	}
	pg.kind[v6] = network
}

func (pg *pinger) listen(addr netip.Addr) (*icmp.PacketConn, string, error) {
	v6 := addr.Is6() && !addr.Is4In6()
	var errs []error
	for _, network := range pg.networks(v6) {
		local := "0.0.0.0"
		if v6 {
			local = "::"
		}
		c, err := icmp.ListenPacket(network, local)
		if err == nil {
			pg.remember(v6, network)
			return c, network, nil
		}
		errs = append(errs, fmt.Errorf("%s: %w", network, err))
	}
	return nil, "", &probeError{reason: "ping_unavailable", err: fmt.Errorf("%w (%v)", ErrPingUnavailable, errors.Join(errs...))}
}

// echo sends one echo request and waits for the matching reply.
func (pg *pinger) echo(ctx context.Context, addr netip.Addr) error {
	addr = addr.Unmap()
	c, network, err := pg.listen(addr)
	if err != nil {
		return err
	}
	defer c.Close()
	v6 := addr.Is6()
	seq := int(pg.seq.Add(1) & 0xffff)
	// Ping sockets (udp*) let the kernel own the identifier; raw sockets see
	// every echo reply on the host, so they match on identifier too.
	id := os.Getpid() & 0xffff
	raw := network[0] == 'i'
	var typ icmp.Type = ipv4.ICMPTypeEcho
	proto := 1
	if v6 {
		typ, proto = ipv6.ICMPTypeEchoRequest, 58
	}
	msg := icmp.Message{Type: typ, Body: &icmp.Echo{ID: id, Seq: seq, Data: []byte("loxilb-health")}}
	b, err := msg.Marshal(nil)
	if err != nil {
		return err
	}
	var dst net.Addr = &net.UDPAddr{IP: addr.AsSlice(), Zone: addr.Zone()}
	if raw {
		dst = &net.IPAddr{IP: addr.AsSlice(), Zone: addr.Zone()}
	}
	deadline, ok := ctx.Deadline()
	if !ok {
		deadline = time.Now().Add(3 * time.Second)
	}
	_ = c.SetDeadline(deadline)
	stop := context.AfterFunc(ctx, func() { _ = c.SetDeadline(time.Now()) })
	defer stop()
	if _, err := c.WriteTo(b, dst); err != nil {
		return err
	}
	buf := make([]byte, 1500)
	for {
		n, peer, err := c.ReadFrom(buf)
		if err != nil {
			if ctx.Err() != nil {
				return ctx.Err()
			}
			return err
		}
		if !samePeer(peer, addr) {
			continue
		}
		m, err := icmp.ParseMessage(proto, buf[:n])
		if err != nil {
			continue
		}
		e, isEcho := m.Body.(*icmp.Echo)
		if !isEcho || e.Seq != seq || (raw && e.ID != id) {
			continue
		}
		switch m.Type {
		case ipv4.ICMPTypeEchoReply, ipv6.ICMPTypeEchoReply:
			return nil
		}
	}
}

func samePeer(a net.Addr, want netip.Addr) bool {
	var ip net.IP
	switch v := a.(type) {
	case *net.UDPAddr:
		ip = v.IP
	case *net.IPAddr:
		ip = v.IP
	default:
		return false
	}
	got, ok := netip.AddrFromSlice(ip)
	return ok && got.Unmap() == want
}
