// Command llmbench runs the routing-quality benchmark: the real loxilb
// daemon in front of emulated vLLM engines on loopback, every workload
// under every routing arm, and writes report.json plus one SVG chart per
// workload.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"path/filepath"
	"strings"

	"github.com/loxilb-llm/loxilb/testbed/bench"
)

func main() {
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "llmbench:", err)
		os.Exit(1)
	}
}

func run() error {
	var (
		suite     = flag.String("suite", "default", "default or tiny")
		seed      = flag.Uint64("seed", 20261129, "workload seed")
		out       = flag.String("out", "", "directory for report.json and the SVG charts (none when empty)")
		binDir    = flag.String("bin", "", "directory holding prebuilt loxilb and loxicmd (built into a temp dir when empty)")
		workloads = flag.String("workloads", "", "comma-separated workloads: shared-prefix-40, shared-prefix-100, multi-turn, multi-turn-long, sibling-bursts, hot-prefix, doc-qa, doc-qa-mixed, doc-qa-mixed-heavy, agent-loop, multi-turn-no-context (all but the last when empty)")
		arms      = flag.String("arms", "", "comma-separated arms to run: rr, chwbl, kv, kv-nospill, kv-load512, kv-fcfs, kv-slots2, kv-notie, chwbl-l1, chwbl-125 (the first four when empty)")
		loxicmd   = flag.Bool("loxicmd", false, "create rules with loxicmd instead of the REST API")
		quiet     = flag.Bool("quiet", false, "no progress bar")
		runs      = flag.Int("runs", 0, "repetitions per arm, medians reported (0: the suite's default, 3 for default)")
		receipts  = flag.String("receipts", "", "write every request's routing receipt and TTFT to this file")
		from      = flag.String("from", "", "re-render the table and charts of an existing report.json instead of running")
		late      = flag.Bool("restart-after-subscribe", false, "empty the engines' caches after each arm's daemon has subscribed and replayed their events, instead of before it starts")
		engine    = flag.String("engine", "vllm", "emulated engine kind of the fleet: vllm (4 engines) or sglang (4 engines x 2 data-parallel ranks, the same KV capacity)")
		netOctet  = flag.Int("net", 0, "third octet of the fleet's loopback addresses 127.0.N.x (0: the suite's own), so two runs can share a machine")
		env       = flag.String("env", "", "extra daemon environment for every arm, KEY=VALUE[,KEY=VALUE], e.g. LOXILB_KV_LOAD_PENALTY=64")
		nodes     = flag.Int("nodes", 1, "also run every arm on this many gateway nodes sharing an etcd store (Debian etcd-server) and the VIP, connections spread over them by the kernel's SO_REUSEPORT hash of each connection's 4-tuple, as ECMP does; the arm is named arm@Nn and runs beside the single-node one in the same run")
	)
	flag.Parse()
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	if *from != "" {
		b, err := os.ReadFile(*from)
		if err != nil {
			return err
		}
		var rep bench.Report
		if err := json.Unmarshal(b, &rep); err != nil {
			return fmt.Errorf("%s: %w", *from, err)
		}
		rep.WriteTable(os.Stdout)
		if *out != "" {
			return rep.WriteFiles(*out)
		}
		return nil
	}

	wd, _ := os.Getwd()
	root, err := bench.FindRepoRoot(wd)
	if err != nil {
		return err
	}
	var s bench.Suite
	switch *suite {
	case "default":
		f, err := bench.FleetFor(*engine)
		if err != nil {
			return err
		}
		s = bench.SuiteOn(*seed, f)
	case "tiny":
		s = bench.TinySuite(*seed, 78)
	default:
		return fmt.Errorf("suite %q: want default or tiny", *suite)
	}
	if *suite != "default" && *engine != "vllm" {
		return fmt.Errorf("-engine %s: only the default suite runs on another fleet", *engine)
	}
	if *netOctet != 0 {
		if *netOctet < 1 || *netOctet > 254 {
			return fmt.Errorf("-net %d: want 1..254", *netOctet)
		}
		s.Fleet.Net = *netOctet
	}
	if *workloads != "" {
		all := s.Workloads
		if *suite == "default" {
			all = append(all, bench.ExtraWorkloads(*seed, s.Fleet)...)
		}
		s.Workloads = filter(all, *workloads, func(w bench.Workload) string { return w.Name })
		if len(s.Workloads) == 0 {
			return errors.New("-workloads matched no workload")
		}
	}
	if *arms != "" {
		s.Arms = filter(bench.AllArms(), *arms, func(a bench.Arm) string { return a.Name })
		if len(s.Arms) == 0 {
			return errors.New("-arms matched no arm")
		}
	}
	if *runs > 0 {
		s.Runs = *runs
	}
	if *nodes < 1 || *nodes > 8 {
		return fmt.Errorf("-nodes %d: want 1..8", *nodes)
	}
	if *nodes > 1 {
		if *loxicmd {
			return errors.New("-nodes creates the shared rule through the API: drop -loxicmd")
		}
		var both []bench.Arm
		for _, a := range s.Arms {
			both = append(both, a, a.OnNodes(*nodes))
		}
		s.Arms = both
	}
	if *env != "" {
		for i := range s.Arms {
			s.Arms[i].Env = append(append([]string(nil), s.Arms[i].Env...), strings.Split(*env, ",")...)
		}
	}
	var bins bench.Binaries
	if *binDir != "" {
		bins = bench.Binaries{Loxilb: filepath.Join(*binDir, "loxilb"), Loxicmd: filepath.Join(*binDir, "loxicmd")}
	} else {
		dir, err := os.MkdirTemp("", "llmbench-bin")
		if err != nil {
			return err
		}
		defer os.RemoveAll(dir)
		fmt.Fprintln(os.Stderr, "building loxilb and loxicmd ...")
		if bins, err = bench.BuildBinaries(ctx, root, dir); err != nil {
			return err
		}
	}
	o := bench.Options{Bin: bins, TokenizerDir: bench.DefaultTokenizerDir(root), UseLoxicmd: *loxicmd, RestartAfterSubscribe: *late}
	if !*quiet {
		o.Progress = os.Stderr
	}
	if *receipts != "" {
		rf, err := os.Create(*receipts)
		if err != nil {
			return err
		}
		defer rf.Close()
		o.Receipts = rf
	}
	rep, err := bench.Run(ctx, s, o)
	if err != nil {
		return err
	}
	rep.WriteTable(os.Stdout)
	if *out != "" {
		if err := rep.WriteFiles(*out); err != nil {
			return err
		}
		fmt.Fprintf(os.Stderr, "wrote %s/report.json and %d charts\n", *out, len(rep.Workloads))
	}
	return nil
}

func filter[T any](items []T, names string, name func(T) string) []T {
	want := map[string]bool{}
	for _, n := range strings.Split(names, ",") {
		want[strings.TrimSpace(n)] = true
	}
	var out []T
	for _, it := range items {
		if want[name(it)] {
			out = append(out, it)
		}
	}
	return out
}
