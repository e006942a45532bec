//go:build linux

package netns

import (
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	cebpf "github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"
	"github.com/cilium/ebpf/link"
	"golang.org/x/sys/unix"

	"github.com/loxilb-llm/loxilb/pkg/dataplane"
	"github.com/loxilb-llm/loxilb/pkg/dataplane/dataplanetest"
	"github.com/loxilb-llm/loxilb/pkg/dataplane/ebpf"
)

var rpsRE = regexp.MustCompile(`Requests/sec:\s+([0-9.]+)`)

// wrk runs one load test from the client namespace and returns requests/s.
func wrk(lab *Lab, url string, connClose bool, dur time.Duration) (float64, error) {
	args := []string{"wrk", "-t1", "-c16", "-d" + strconv.Itoa(int(dur.Seconds())) + "s"}
	if connClose {
		args = append(args, "-H", "Connection: close")
	}
	out, err := Exec(lab.Client, append(args, url)...)
	if err != nil {
		return 0, err
	}
	m := rpsRE.FindStringSubmatch(out)
	if m == nil {
		return 0, fmt.Errorf("no Requests/sec in wrk output: %s", out)
	}
	return strconv.ParseFloat(m[1], 64)
}

// BenchmarkVIPThroughput compares requests/s through a mode-0 VIP with
// plain routing to the backend and with nftables DNAT, interleaving the
// scenarios so slow phases of the shared machine hit all of them, and reads
// tc_lb's per-packet cost from the kernel's BPF run-time statistics, next
// to an empty TC program's (the floor those statistics cannot go under) and
// to the reference DNAT program's (refdnat.c: the cheapest conntrack hit,
// rewrite and redirect, the floor of any DNAT hit on the machine).
// Run: go test -run '^$' -bench VIPThroughput ./testbed/netns/ (root, wrk, nft);
// LOXILB_BENCH_ROUNDS sets the rounds per scenario (default 2),
// LOXILB_BENCH_KEEPALIVE_ONLY=1 skips the connection-per-request half.
func BenchmarkVIPThroughput(b *testing.B) {
	dataplanetest.RequirePrivileged(b)
	for _, tool := range []string{"wrk", "nft", "curl"} {
		if _, err := exec.LookPath(tool); err != nil {
			b.Skipf("skipping: %s not installed (apt-get install wrk nftables curl)", tool)
		}
	}
	if !dataplanetest.InNetNS() {
		lab, err := Build(1)
		if err != nil {
			b.Fatal(err)
		}
		defer lab.Destroy()
		startBackend(b, lab.Backends[0], "be1")
		desc := fmt.Sprintf(`{"Client":%q,"LB":%q,"Backends":[%q],"LBIfaces":[%q,%q]}`, lab.Client, lab.LB, lab.Backends[0], lab.LBIfaces[0], lab.LBIfaces[1])
		dataplanetest.RunBenchInNetNS(b, lab.LB, labEnv+"="+desc)
		return
	}
	lab := &Lab{}
	if err := jsonLab(lab); err != nil {
		b.Fatal(err)
	}
	dur := 3 * time.Second
	vip := VIP(1)
	backend := BackendAddr(0)
	// Direct traffic uses the backend's other port: mode 0 keeps the client's
	// address, so direct and VIP connections to one port would share 4-tuples
	// at the backend, and the direct runs' TIME_WAIT sockets (with another
	// ISN and timestamp base) would stall the VIP runs' SYNs.
	direct := fmt.Sprintf("http://%s:80/", backend)
	viaVIP := fmt.Sprintf("http://%s:80/", vip)
	ctx := context.Background()

	stats, err := cebpf.EnableStats(uint32(unix.BPF_STATS_RUN_TIME))
	if err != nil {
		b.Fatalf("enable BPF run-time statistics: %v", err)
	}
	defer stats.Close()

	type result struct {
		rps      []float64
		nsPerPkt []float64
	}
	results := map[string]*result{}
	add := func(name string, rps, ns float64) {
		r := results[name]
		if r == nil {
			r = &result{}
			results[name] = r
		}
		r.rps = append(r.rps, rps)
		if ns > 0 {
			r.nsPerPkt = append(r.nsPerPkt, ns)
		}
	}
	withDP := func(cfg ebpf.Config, svc bool, url string, connClose bool) (float64, float64) {
		cfg.Interfaces = lab.LBIfaces
		d, err := ebpf.New(cfg, nil)
		if err != nil {
			b.Fatal(err)
		}
		defer d.Close()
		if svc {
			if err := d.UpsertService(ctx, dataplane.Service{ID: 1, VIP: vip, Port: 80, Proto: "tcp"},
				[]dataplane.Endpoint{{Addr: backend, Port: 8080, Healthy: true}}); err != nil {
				b.Fatal(err)
			}
		}
		runs0, t0, _ := d.ProgramRuntime()
		rps, err := wrk(lab, url, connClose, dur)
		if err != nil {
			b.Fatal(err)
		}
		runs1, t1, _ := d.ProgramRuntime()
		if st, err := d.Stats(ctx); err == nil {
			var nz []string
			for k, v := range st.Counters {
				if v != 0 && (strings.HasPrefix(k, "drop_") || k == "flow_reopened" || k == "fwd_stack") {
					nz = append(nz, fmt.Sprintf("%s=%d", k, v))
				}
			}
			fmt.Fprintf(os.Stderr, "  %s stack=%v close=%v: %v\n", url, cfg.StackForwarding, connClose, nz)
		}
		return rps, float64(t1-t0) / float64(max(runs1-runs0, 1))
	}
	// live runs wrk with prog attached to TC ingress of the LB's interfaces
	// where tc_lb would be, and returns requests/s and prog's ns per run.
	live := func(prog *cebpf.Program, url string, connClose bool) (float64, float64) {
		for _, name := range lab.LBIfaces {
			iface, err := net.InterfaceByName(name)
			if err != nil {
				b.Fatal(err)
			}
			l, err := link.AttachTCX(link.TCXOptions{Interface: iface.Index, Program: prog, Attach: cebpf.AttachTCXIngress})
			if err != nil { // a kernel before TCX (6.6): the data plane falls back, this scenario is left out
				fmt.Fprintf(os.Stderr, "  %s not measured: %v\n", prog, err)
				rps, err := wrk(lab, url, connClose, dur)
				if err != nil {
					b.Fatal(err)
				}
				return rps, 0
			}
			defer l.Close()
		}
		st0, _ := prog.Stats()
		rps, err := wrk(lab, url, connClose, dur)
		if err != nil {
			b.Fatal(err)
		}
		st1, _ := prog.Stats()
		if st0 == nil || st1 == nil {
			return rps, 0
		}
		return rps, float64(st1.Runtime-st0.Runtime) / float64(max(st1.RunCount-st0.RunCount, 1))
	}
	// floor runs wrk with an empty TC program (return TC_ACT_OK) attached
	// where tc_lb would be: its ns per packet is what entering a TC program
	// and the run-time statistics themselves cost on this machine, the
	// floor under every tc_lb figure of the same run.
	floor := func(url string, connClose bool) (float64, float64) {
		prog, err := cebpf.NewProgram(&cebpf.ProgramSpec{
			Name: "tc_empty", Type: cebpf.SchedCLS, License: "GPL",
			Instructions: asm.Instructions{asm.Mov.Imm(asm.R0, 0), asm.Return()},
		})
		if err != nil {
			b.Fatal(err)
		}
		defer prog.Close()
		return live(prog, url, connClose)
	}
	// refDNAT runs wrk through the VIP with the reference DNAT program
	// (refdnat.c) in tc_lb's place: a conntrack hit, the rewrite and the
	// redirect and nothing else, the floor of any DNAT hit here.
	refDNAT := func(url string, connClose bool) (float64, float64) {
		prog, closeRef, err := loadRefDNAT(vip, 80, backend, 8080)
		if err != nil {
			b.Fatal(err)
		}
		defer closeRef()
		return live(prog, url, connClose)
	}
	nft := func(url string, connClose bool) float64 {
		rules := fmt.Sprintf("table ip lbbench { chain pre { type nat hook prerouting priority dstnat; ip daddr %s tcp dport 80 dnat to %s:8080; }; }", vip, backend)
		if err := dataplanetest.Run("nft", rules); err != nil {
			b.Fatal(err)
		}
		defer dataplanetest.Run("nft", "delete", "table", "ip", "lbbench")
		rps, err := wrk(lab, url, connClose, dur)
		if err != nil {
			b.Fatal(err)
		}
		return rps
	}

	rounds := 2
	if n, err := strconv.Atoi(os.Getenv("LOXILB_BENCH_ROUNDS")); err == nil && n > 0 {
		rounds = n
	}
	modes := []bool{false, true}
	if os.Getenv("LOXILB_BENCH_KEEPALIVE_ONLY") != "" {
		modes = modes[:1]
	}
	for _, cc := range modes {
		suffix := "keepalive"
		if cc {
			suffix = "connclose"
		}
		for range rounds {
			rps, err := wrk(lab, direct, cc, dur)
			if err != nil {
				b.Fatal(err)
			}
			add("direct/"+suffix, rps, 0)
			rps, ns := floor(direct, cc)
			add("direct+empty(floor)/"+suffix, rps, ns)
			rps, ns = withDP(ebpf.Config{}, false, direct, cc)
			add("direct+tc_lb(miss)/"+suffix, rps, ns)
			rps, ns = withDP(ebpf.Config{}, true, viaVIP, cc)
			add("mode0-fib/"+suffix, rps, ns)
			rps, ns = refDNAT(viaVIP, cc)
			add("ref-dnat/"+suffix, rps, ns)
			rps, ns = withDP(ebpf.Config{StackForwarding: true}, true, viaVIP, cc)
			add("mode0-stack/"+suffix, rps, ns)
			add("nft-dnat/"+suffix, nft(viaVIP, cc), 0)
		}
	}
	mean := func(v []float64) float64 {
		s := 0.0
		for _, x := range v {
			s += x
		}
		return s / float64(max(len(v), 1))
	}
	median := func(v []float64) float64 {
		s := slices.Clone(v)
		slices.Sort(s)
		if len(s) == 0 {
			return 0
		}
		return s[len(s)/2]
	}
	var report strings.Builder
	for _, name := range []string{"direct", "direct+empty(floor)", "direct+tc_lb(miss)", "mode0-fib", "ref-dnat", "mode0-stack", "nft-dnat"} {
		for _, suffix := range []string{"keepalive", "connclose"} {
			r := results[name+"/"+suffix]
			if r == nil {
				continue
			}
			fmt.Fprintf(&report, "%-22s %-9s rps %v mean %.0f", name, suffix, r.rps, mean(r.rps))
			if len(r.nsPerPkt) > 0 {
				fmt.Fprintf(&report, " ns/pkt %.0f median %.0f", r.nsPerPkt, median(r.nsPerPkt))
				if fl := results["direct+empty(floor)/"+suffix]; fl != nil && r != fl && len(fl.nsPerPkt) == len(r.nsPerPkt) {
					// Each round's floor was measured seconds before its scenarios.
					above := make([]float64, len(r.nsPerPkt))
					for i := range above {
						above[i] = r.nsPerPkt[i] - fl.nsPerPkt[i]
					}
					fmt.Fprintf(&report, " above floor %.0f median %.0f", above, median(above))
				}
			}
			report.WriteString("\n")
		}
	}
	for _, suffix := range []string{"keepalive", "connclose"} {
		if results["mode0-fib/"+suffix] == nil {
			continue
		}
		m := mean(results["mode0-fib/"+suffix].rps)
		fmt.Fprintf(&report, "%s: mode0-fib/direct %.3f  mode0-fib/nft-dnat %.3f  mode0-stack/direct %.3f  ref-dnat/direct %.3f\n", suffix,
			m/mean(results["direct/"+suffix].rps), m/mean(results["nft-dnat/"+suffix].rps),
			mean(results["mode0-stack/"+suffix].rps)/mean(results["direct/"+suffix].rps),
			mean(results["ref-dnat/"+suffix].rps)/mean(results["direct/"+suffix].rps))
	}
	fmt.Fprint(os.Stderr, report.String())
	b.ReportMetric(mean(results["mode0-fib/keepalive"].rps)/mean(results["direct/keepalive"].rps), "vip/direct")
	b.ReportMetric(mean(results["mode0-fib/keepalive"].rps)/mean(results["nft-dnat/keepalive"].rps), "vip/nft")
	b.ReportMetric(median(results["mode0-fib/keepalive"].nsPerPkt), "ns/pkt-hit")
	b.ReportMetric(median(results["direct+tc_lb(miss)/keepalive"].nsPerPkt), "ns/pkt-miss")
	b.ReportMetric(median(results["direct+empty(floor)/keepalive"].nsPerPkt), "ns/pkt-floor")
	b.ReportMetric(median(results["ref-dnat/keepalive"].nsPerPkt), "ns/pkt-ref")
}
