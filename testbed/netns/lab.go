package netns

import (
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"net/netip"
	"os/exec"
	"strings"
)

// Lab is a built topology. Names are unique per lab, so labs of concurrent
// test runs do not collide.
type Lab struct {
	Client   string   // client namespace
	LB       string   // load-balancer namespace
	Backends []string // backend namespaces
	// LBIfaces are the LB's interfaces, client side first.
	LBIfaces []string
}

// ClientAddr is the client's address.
func ClientAddr() netip.Addr { return netip.AddrFrom4([4]byte{172, 30, 1, 2}) }

// LBClientIP is the LB's address on the client link (the client's gateway).
func LBClientIP() netip.Addr { return netip.AddrFrom4([4]byte{172, 30, 1, 1}) }

// BackendAddr is backend i's address (0-based).
func BackendAddr(i int) netip.Addr { return netip.AddrFrom4([4]byte{172, 30, byte(11 + i), 2}) }

// LBBackendIP is the LB's address on backend i's link.
func LBBackendIP(i int) netip.Addr { return netip.AddrFrom4([4]byte{172, 30, byte(11 + i), 1}) }

// VIP returns VIP number n of the lab.
func VIP(n int) netip.Addr { return netip.AddrFrom4([4]byte{172, 30, 100, byte(n)}) }

func run(args ...string) error {
	out, err := exec.Command(args[0], args[1:]...).CombinedOutput()
	if err != nil {
		return fmt.Errorf("%s: %w: %s", strings.Join(args, " "), err, strings.TrimSpace(string(out)))
	}
	return nil
}

// Build creates the lab with n backends. On error it removes what it made.
func Build(n int) (*Lab, error) {
	var b [3]byte
	rand.Read(b[:])
	id := hex.EncodeToString(b[:])
	l := &Lab{Client: "lbcli" + id, LB: "lblb" + id}
	for i := range n {
		l.Backends = append(l.Backends, fmt.Sprintf("lbbe%d%s", i+1, id))
	}
	if err := l.build(); err != nil {
		return nil, errors.Join(err, l.Destroy())
	}
	return l, nil
}

func (l *Lab) build() error {
	var cmds [][]string
	add := func(args ...string) { cmds = append(cmds, args) }
	for _, ns := range append([]string{l.Client, l.LB}, l.Backends...) {
		add("ip", "netns", "add", ns)
		add("ip", "-n", ns, "link", "set", "lo", "up")
	}
	sysctl := func(ns, kv string) { add("ip", "netns", "exec", ns, "sysctl", "-qw", kv) }
	sysctl(l.LB, "net.ipv4.ip_forward=1")
	sysctl(l.LB, "net.ipv4.conf.all.rp_filter=0")
	sysctl(l.LB, "net.ipv4.conf.default.rp_filter=0")

	link := func(lbIf, peerNS, peerIf string, lbIP, peerIP netip.Addr) {
		cmds = append(cmds, vethCmds(l.LB, lbIf, peerNS, peerIf, lbIP, peerIP)...)
		l.LBIfaces = append(l.LBIfaces, lbIf)
	}
	link("l0", l.Client, "c0", LBClientIP(), ClientAddr())
	for i, be := range l.Backends {
		link(fmt.Sprintf("b%d", i+1), be, "e0", LBBackendIP(i), BackendAddr(i))
		sysctl(be, "net.ipv4.conf.all.rp_filter=0")
		sysctl(be, "net.ipv4.conf.e0.rp_filter=0")
	}
	for _, c := range cmds {
		if err := run(c...); err != nil {
			return err
		}
	}
	for _, lbIf := range l.LBIfaces {
		if err := run("ip", "netns", "exec", l.LB, "sysctl", "-qw", "net.ipv4.conf."+lbIf+".rp_filter=0"); err != nil {
			return err
		}
	}
	return nil
}

// vethCmds are the commands linking namespace hub to peerNS with a /24
// veth pair, the peer routing everything via hub. The pair is created in
// hub and its peer end moved out, so host interface names are never used.
func vethCmds(hub, hubIf, peerNS, peerIf string, hubIP, peerIP netip.Addr) [][]string {
	return [][]string{
		{"ip", "-n", hub, "link", "add", hubIf, "type", "veth", "peer", "name", peerIf, "netns", peerNS},
		{"ip", "-n", hub, "addr", "add", hubIP.String() + "/24", "dev", hubIf},
		{"ip", "-n", peerNS, "addr", "add", peerIP.String() + "/24", "dev", peerIf},
		{"ip", "-n", hub, "link", "set", hubIf, "up"},
		{"ip", "-n", peerNS, "link", "set", peerIf, "up"},
		{"ip", "-n", peerNS, "route", "add", "default", "via", hubIP.String()},
	}
}

// AddVIPToBackends puts vip on lo of every backend, as DSR requires.
func (l *Lab) AddVIPToBackends(vip netip.Addr) error {
	for _, be := range l.Backends {
		if err := run("ip", "-n", be, "addr", "replace", vip.String()+"/32", "dev", "lo"); err != nil {
			return err
		}
	}
	return nil
}

// Destroy deletes the lab's namespaces (veths go with them).
func (l *Lab) Destroy() error {
	var errs []error
	for _, ns := range append([]string{l.Client, l.LB}, l.Backends...) {
		if err := exec.Command("ip", "netns", "del", ns).Run(); err != nil {
			if exec.Command("ip", "netns", "pids", ns).Run() == nil { // still there
				errs = append(errs, fmt.Errorf("delete namespace %s: %w", ns, err))
			}
		}
	}
	return errors.Join(errs...)
}

// Exec runs a command inside namespace ns (network only) and returns its
// standard output.
func Exec(ns string, args ...string) (string, error) {
	cmd := exec.Command("nsenter", append([]string{"--net=/run/netns/" + ns}, args...)...)
	var stderr strings.Builder
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		return string(out), fmt.Errorf("in %s: %s: %w: %s", ns, strings.Join(args, " "), err, strings.TrimSpace(stderr.String()))
	}
	return string(out), nil
}
