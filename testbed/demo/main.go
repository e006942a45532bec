// Command demo shows KV-aware routing on one machine without root: it
// starts four emulated vLLM engines on loopback addresses and the loxilb
// daemon (proxy-only), creates the mode-4 rule with loxicmd, sends a short
// workload through the VIP under round robin and then under KV-exact
// routing, prints both side by side, and cleans up.
package main

import (
	"bytes"
	"context"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"path/filepath"
	"regexp"
	"strings"
	"text/tabwriter"

	"github.com/loxilb-llm/loxilb/testbed/bench"
)

func main() {
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "demo:", err)
		os.Exit(1)
	}
}

func run() error {
	binDir := flag.String("bin", "", "directory holding loxilb and loxicmd (built into a temp dir when empty)")
	seed := flag.Uint64("seed", 20261129, "workload seed")
	flag.Parse()
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	wd, _ := os.Getwd()
	root, err := bench.FindRepoRoot(wd)
	if err != nil {
		return err
	}
	var bins bench.Binaries
	if *binDir != "" {
		bins = bench.Binaries{Loxilb: filepath.Join(*binDir, "loxilb"), Loxicmd: filepath.Join(*binDir, "loxicmd")}
	} else {
		tmp, err := os.MkdirTemp("", "loxilb-demo-bin")
		if err != nil {
			return err
		}
		defer os.RemoveAll(tmp)
		if bins, err = bench.BuildBinaries(ctx, root, tmp); err != nil {
			return err
		}
	}
	s := bench.DemoSuite(*seed, 99)
	f := s.Fleet
	fmt.Printf("Four vLLM emulators on 127.0.%d.11-14:%d (KV events on ZMQ :%d), the daemon proxy-only, VIP 127.0.%d.1:%d.\n",
		f.Net, f.Port, f.ZMQPort, f.Net, f.VIPPort)
	fmt.Printf("Each arm starts cold: a fresh daemon, the rule created with loxicmd, emptied engine caches.\n\n")
	var cmds bytes.Buffer
	rep, err := bench.Run(ctx, s, bench.Options{Bin: bins, TokenizerDir: bench.DefaultTokenizerDir(root),
		UseLoxicmd: true, Progress: os.Stderr, Commands: &cmds})
	if err != nil {
		return err
	}
	fmt.Println("The rules were created with (PORT: the daemon's API port of that arm):")
	seen := map[string]bool{}
	for _, c := range strings.Split(strings.TrimSpace(cmds.String()), "\n") {
		c = apiPort.ReplaceAllString(c, "-p PORT ")
		if !seen[c] {
			seen[c] = true
			fmt.Println("  " + c)
		}
	}
	for _, a := range rep.Suite.Arms {
		if len(a.Env) > 0 {
			fmt.Printf("The %s arm's daemon ran with: %s\n", a.Label, strings.Join(a.Env, " "))
		}
	}
	fmt.Println()
	for _, w := range rep.Workloads {
		rr, kv := w.Arm(bench.ArmRR.Name), w.Arm(bench.ArmKV.Name)
		fmt.Printf("%s\n  %s\n", w.Workload.Title, w.Workload.Description)
		tw := tabwriter.NewWriter(os.Stdout, 0, 0, 3, ' ', 0)
		fmt.Fprintf(tw, "\tround robin\tKV-exact\t\n")
		fmt.Fprintf(tw, "cache hit ratio (engines' counters)\t%.2f\t%.2f\t(one LRU cache of the fleet's size: %.2f)\n", rr.HitRatio, kv.HitRatio, w.Bound.FleetLRU)
		fmt.Fprintf(tw, "TTFT p50\t%.0f ms\t%.0f ms\t\n", rr.TTFTms.P50, kv.TTFTms.P50)
		fmt.Fprintf(tw, "TTFT p90\t%.0f ms\t%.0f ms\t\n", rr.TTFTms.P90, kv.TTFTms.P90)
		fmt.Fprintf(tw, "requests per engine\t%s\t%s\t\n", ints(rr.PerEndpoint), ints(kv.PerEndpoint))
		fmt.Fprintf(tw, "errors\t%d\t%d\t\n", rr.Errors, kv.Errors)
		tw.Flush()
		fmt.Println()
	}
	fmt.Println("Engines, daemon and temporary state are gone. Full benchmark: make bench-routing (see BENCHMARKS.md).")
	return nil
}

var apiPort = regexp.MustCompile(`-p [0-9]+ `)

func ints(v []int) string {
	s := make([]string, len(v))
	for i, n := range v {
		s[i] = fmt.Sprint(n)
	}
	return strings.Join(s, " ")
}
