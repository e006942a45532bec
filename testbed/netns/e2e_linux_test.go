//go:build linux

package netns

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/loxilb-llm/loxilb/pkg/dataplane"
	"github.com/loxilb-llm/loxilb/pkg/dataplane/dataplanetest"
	"github.com/loxilb-llm/loxilb/pkg/dataplane/ebpf"
)

const labEnv = "LOXILB_LAB"

func requireCurl(t *testing.T) {
	if _, err := exec.LookPath("curl"); err != nil {
		if os.Getenv("CI") == "true" {
			t.Fatal("curl is required for the lab tests in CI")
		}
		t.Skip("skipping: curl not installed")
	}
}

// withLab builds a lab with n backends, starts the backend servers and
// re-runs the test inside the LB namespace. It returns the lab in the child
// (where the body runs) and nil in the parent.
func withLab(t *testing.T, n int) *Lab {
	t.Helper()
	dataplanetest.RequirePrivileged(t)
	requireCurl(t)
	if dataplanetest.InNetNS() {
		var lab Lab
		if err := jsonLab(&lab); err != nil {
			t.Fatal(err)
		}
		return &lab
	}
	lab, err := Build(n)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := lab.Destroy(); err != nil {
			t.Error(err)
		}
	})
	for i, be := range lab.Backends {
		startBackend(t, be, fmt.Sprintf("be%d", i+1))
	}
	desc, _ := json.Marshal(lab)
	dataplanetest.RunInNetNS(t, lab.LB, labEnv+"="+string(desc))
	return nil
}

func jsonLab(lab *Lab) error {
	if err := json.Unmarshal([]byte(os.Getenv(labEnv)), lab); err != nil {
		return fmt.Errorf("lab description: %w", err)
	}
	return nil
}

func startBackend(t testing.TB, ns, name string) {
	t.Helper()
	cmd := exec.Command("nsenter", "--net=/run/netns/"+ns, os.Args[0])
	cmd.Env = append(os.Environ(), roleEnv+"=backend", "LOXILB_LAB_NAME="+name)
	stdin, _ := cmd.StdinPipe()
	stdout, _ := cmd.StdoutPipe()
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		stdin.Close()
		cmd.Process.Kill()
		cmd.Wait()
	})
	line, err := bufio.NewReader(stdout).ReadString('\n')
	if err != nil || strings.TrimSpace(line) != "ready" {
		t.Fatalf("backend %s: %q %v", name, line, err)
	}
}

// reply is what a backend answered.
type reply struct {
	name, remote, local string
}

func parseReply(s string) (reply, error) {
	var r reply
	for _, f := range strings.Fields(s) {
		k, v, _ := strings.Cut(f, "=")
		switch k {
		case "name":
			r.name = v
		case "remote":
			r.remote = v
		case "local":
			r.local = v
		}
	}
	if r.name == "" {
		return r, fmt.Errorf("unexpected answer %q", s)
	}
	return r, nil
}

func curl(t *testing.T, lab *Lab, vip netip.Addr, port uint16) reply {
	t.Helper()
	out, err := Exec(lab.Client, "curl", "-sS", "--max-time", "5", fmt.Sprintf("http://%s:%d/", vip, port))
	if err != nil {
		t.Fatalf("curl %v:%d: %v", vip, port, err)
	}
	r, err := parseReply(out)
	if err != nil {
		t.Fatal(err)
	}
	return r
}

func host(addrPort string) string {
	h, _, _ := net.SplitHostPort(addrPort)
	return h
}

func labEndpoints(lab *Lab, port uint16) []dataplane.Endpoint {
	var eps []dataplane.Endpoint
	for i := range lab.Backends {
		eps = append(eps, dataplane.Endpoint{Addr: BackendAddr(i), Port: port, Weight: 1, Healthy: true})
	}
	return eps
}

func TestLab(t *testing.T) {
	lab := withLab(t, 3)
	if lab == nil {
		return
	}
	ctx := context.Background()
	d, err := ebpf.New(ebpf.Config{Interfaces: lab.LBIfaces, GCInterval: 200 * time.Millisecond}, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	upsert := func(t *testing.T, s dataplane.Service, eps []dataplane.Endpoint) {
		t.Helper()
		if s.Proto == "" {
			s.Proto = "tcp"
		}
		if err := d.UpsertService(ctx, s, eps); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { d.DeleteService(ctx, s.ID) })
	}

	t.Run("Mode0RoundRobin", func(t *testing.T) {
		vip := VIP(1)
		upsert(t, dataplane.Service{ID: 1, VIP: vip, Port: 80, Mode: dataplane.ModeDNAT, Sel: dataplane.SelRoundRobin}, labEndpoints(lab, 8080))
		var order []string
		for range 9 {
			r := curl(t, lab, vip, 80)
			if host(r.remote) != ClientAddr().String() {
				t.Fatalf("mode 0 must keep the client address: backend saw %s", r.remote)
			}
			order = append(order, r.name)
		}
		want := "be1 be2 be3 be1 be2 be3 be1 be2 be3"
		if got := strings.Join(order, " "); got != want {
			t.Fatalf("rr order %q, want %q", got, want)
		}
	})

	t.Run("Mode1OneArm", func(t *testing.T) {
		vip := VIP(2)
		upsert(t, dataplane.Service{ID: 2, VIP: vip, Port: 80, Mode: dataplane.ModeOneArm, Sel: dataplane.SelRoundRobin}, labEndpoints(lab, 8080))
		for range 6 {
			r := curl(t, lab, vip, 80)
			i := int(r.name[2] - '1')
			if host(r.remote) != LBBackendIP(i).String() {
				t.Fatalf("one-arm: %s saw %s, want the LB's address %v", r.name, r.remote, LBBackendIP(i))
			}
		}
	})

	t.Run("Mode2FullNAT", func(t *testing.T) {
		vip := VIP(3)
		upsert(t, dataplane.Service{ID: 3, VIP: vip, Port: 80, Mode: dataplane.ModeFullNAT, Sel: dataplane.SelHash}, labEndpoints(lab, 8080))
		seen := map[string]bool{}
		for range 12 {
			r := curl(t, lab, vip, 80)
			if host(r.remote) != vip.String() {
				t.Fatalf("full NAT: backend saw %s, want the VIP", r.remote)
			}
			seen[r.name] = true
		}
		if len(seen) < 2 {
			t.Fatalf("hash sent 12 connections to %v", seen)
		}
	})

	t.Run("Mode3DSR", func(t *testing.T) {
		vip := VIP(4)
		if err := (&Lab{Backends: lab.Backends}).AddVIPToBackends(vip); err != nil {
			t.Fatal(err)
		}
		upsert(t, dataplane.Service{ID: 4, VIP: vip, Port: 80, Mode: dataplane.ModeDSR, Sel: dataplane.SelHash}, labEndpoints(lab, 80))
		seen := map[string]bool{}
		for range 12 {
			r := curl(t, lab, vip, 80)
			if r.local != vip.String()+":80" || host(r.remote) != ClientAddr().String() {
				t.Fatalf("dsr: backend saw local %s remote %s", r.local, r.remote)
			}
			seen[r.name] = true
		}
		if len(seen) < 2 {
			t.Fatalf("hash sent 12 connections to %v", seen)
		}
	})

	t.Run("Mode4Proxy", func(t *testing.T) {
		vip := VIP(5)
		lc := net.ListenConfig{}
		lc.SetMultipathTCP(false)
		ln, err := lc.Listen(ctx, "tcp4", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		port := uint16(ln.Addr().(*net.TCPAddr).Port)
		if err := d.RegisterProxyListener(port, ln.(*net.TCPListener)); err != nil {
			ln.Close()
			t.Fatal(err)
		}
		upsert(t, dataplane.Service{ID: 5, VIP: vip, Port: 80, Mode: dataplane.ModeFullProxy, ProxyPort: port}, labEndpoints(lab, 8080))
		locals := make(chan string, 16)
		var wg sync.WaitGroup
		acceptDone := make(chan struct{})
		// Stop accepting before waiting for the copies: wg.Add in the accept
		// loop must not race with wg.Wait.
		defer func() { ln.Close(); <-acceptDone; wg.Wait() }()
		go func() {
			defer close(acceptDone)
			for {
				c, err := ln.Accept()
				if err != nil {
					return
				}
				locals <- c.LocalAddr().String()
				wg.Add(1)
				go func() { // a minimal L4 proxy to backend 2
					defer wg.Done()
					defer c.Close()
					up, err := net.Dial("tcp4", BackendAddr(1).String()+":8080")
					if err != nil {
						return
					}
					defer up.Close()
					go func() {
						io.Copy(up, c)
						up.(*net.TCPConn).CloseWrite() // let the keep-alive backend close
					}()
					io.Copy(c, up)
				}()
			}
		}()
		for range 5 {
			r := curl(t, lab, vip, 80)
			if r.name != "be2" {
				t.Fatalf("proxied answer from %s", r.name)
			}
			if l := <-locals; l != vip.String()+":80" {
				t.Fatalf("proxy saw local address %s, want the VIP", l)
			}
		}
	})

	t.Run("PersistSticks", func(t *testing.T) {
		vip := VIP(6)
		upsert(t, dataplane.Service{ID: 6, VIP: vip, Port: 80, Sel: dataplane.SelPersist}, labEndpoints(lab, 8080))
		first := curl(t, lab, vip, 80).name
		for range 8 {
			if r := curl(t, lab, vip, 80); r.name != first {
				t.Fatalf("persist: moved from %s to %s", first, r.name)
			}
		}
	})

	t.Run("DownBackendGetsNothing", func(t *testing.T) {
		vip := VIP(7)
		upsert(t, dataplane.Service{ID: 7, VIP: vip, Port: 80, Sel: dataplane.SelRoundRobin}, labEndpoints(lab, 8080))
		if err := d.SetEndpointHealth(ctx, 7, 1, false); err != nil {
			t.Fatal(err)
		}
		count := map[string]int{}
		for range 10 {
			count[curl(t, lab, vip, 80).name]++
		}
		if count["be2"] != 0 || count["be1"] != 5 || count["be3"] != 5 {
			t.Fatalf("with be2 down: %v", count)
		}
		if err := d.SetEndpointHealth(ctx, 7, 1, true); err != nil {
			t.Fatal(err)
		}
		count = map[string]int{}
		for range 9 {
			count[curl(t, lab, vip, 80).name]++
		}
		if count["be2"] != 3 {
			t.Fatalf("be2 back up: %v", count)
		}
	})

	t.Run("ConntrackExpires", func(t *testing.T) {
		vip := VIP(8)
		upsert(t, dataplane.Service{ID: 8, VIP: vip, Port: 80, InactiveTimeout: time.Second}, labEndpoints(lab, 8080))
		for range 3 {
			curl(t, lab, vip, 80)
		}
		d.GC()
		st, _ := d.Stats(ctx)
		if st.ConntrackEntries == 0 {
			t.Fatal("no conntrack entries right after the connections")
		}
		// Entries go after the 1 s timeout; poll the GC result rather than
		// assume how quickly this shared machine runs.
		for i := 0; ; i++ {
			st, _ = d.Stats(ctx)
			if st.ConntrackEntries == 0 {
				break
			}
			if i == 100 {
				t.Fatalf("%d conntrack entries left after 20 s", st.ConntrackEntries)
			}
			time.Sleep(200 * time.Millisecond)
		}
	})

	t.Run("ReusedClientPorts", func(t *testing.T) {
		vip := VIP(9)
		upsert(t, dataplane.Service{ID: 9, VIP: vip, Port: 80, Sel: dataplane.SelRoundRobin}, labEndpoints(lab, 8080))
		cmd := exec.Command("nsenter", "--net=/run/netns/"+lab.Client, os.Args[0])
		cmd.Env = append(os.Environ(), roleEnv+"=client", "LOXILB_LAB_TARGET="+vip.String()+":80", "LOXILB_LAB_COUNT=60", "LOXILB_LAB_PORT=40123")
		out, err := cmd.CombinedOutput()
		if err != nil {
			t.Fatalf("client: %v\n%s", err, out)
		}
		lines := strings.Fields(string(out))
		if len(lines) != 60 {
			t.Fatalf("%d answers, want 60: %s", len(lines), out)
		}
		st, _ := d.Stats(ctx)
		if st.Counters["flow_reopened"] < 59 {
			t.Fatalf("flow_reopened = %d, want >= 59 (every connection after the first reuses the tuple)", st.Counters["flow_reopened"])
		}
	})

	st, err := d.Stats(ctx)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("counters: %v", st.Counters)
	for _, bad := range []string{"drop_malformed", "drop_ct_insert", "drop_rewrite", "drop_snat_exhausted", "drop_no_route"} {
		if st.Counters[bad] != 0 {
			t.Errorf("counter %s = %d", bad, st.Counters[bad])
		}
	}

	// The same through the kernel's forwarding path instead of the FIB
	// redirect (Config.StackForwarding), for modes 0 and 2.
	if err := d.Close(); err != nil {
		t.Fatal(err)
	}
	ds, err := ebpf.New(ebpf.Config{Interfaces: lab.LBIfaces, StackForwarding: true}, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer ds.Close()
	for _, mode := range []int{dataplane.ModeDNAT, dataplane.ModeFullNAT} {
		vip := VIP(20 + mode)
		if err := ds.UpsertService(ctx, dataplane.Service{ID: 20, VIP: vip, Port: 80, Proto: "tcp", Mode: mode}, labEndpoints(lab, 8080)); err != nil {
			t.Fatal(err)
		}
		for i := range 3 {
			if r := curl(t, lab, vip, 80); r.name != fmt.Sprintf("be%d", i+1) {
				t.Fatalf("stack forwarding, mode %d: answer %d from %s", mode, i, r.name)
			}
		}
		if err := ds.DeleteService(ctx, 20); err != nil {
			t.Fatal(err)
		}
	}
	if st, _ := ds.Stats(ctx); st.Counters["fwd_stack"] == 0 || st.Counters["fwd_redirect"] != 0 {
		t.Fatalf("stack forwarding counters: %v", st.Counters)
	}
}
