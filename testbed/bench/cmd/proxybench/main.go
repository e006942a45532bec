// Command proxybench measures the mode-4 proxy side by side with HAProxy
// and with no proxy at all, the way a user would: wrk drives small
// keep-alive POSTs at the real loxilb daemon process (one mode-4 round
// robin rule in front of one loopback backend), at Debian's haproxy
// configured as the same reverse proxy, and at the backend directly.
//
// Each concurrency level runs every contender in turn, the order rotated
// from one repetition to the next, so the shared machine's noise hits all
// alike; the table gives the median of the repetitions. Per contender and
// concurrency it reports requests/s, wrk's p99 latency, the proxy
// process's CPU time per request (/proc/PID/stat) and the ratio of its
// requests/s to HAProxy's. -sse N makes every answer an event stream of
// N events, each flushed on its own, and adds CPU time per event (chunk).
// -syscalls adds one run per proxy under
// `strace -c` and reports system calls per request. -compare BIN runs a
// second daemon build as a fourth contender in the same run, to measure a
// change against its base.
//
// -ttfb measures something else: what a KV-exact rule adds to the time to
// first byte of a ~2k-token chat request (ttfb.go); -compare works there
// too.
//
//	make bench-proxy
//	make bench-proxy ARGS='-duration 10s -conns 64 -compare /tmp/loxilb-main'
//	make bench-ttfb
//	make bench-ttfb TTFB_ARGS='-compare /tmp/loxilb-main'
//	make bench-ttfb TTFB_ARGS='-daemon-env GODEBUG=gctrace=1 -daemon-log /tmp/ttfb-logs'
//	make bench-ttfb TTFB_ARGS='-compare bin/loxilb -compare-env GOGC=off'
//
// Needs wrk and haproxy (apt-get install wrk haproxy); strace for -syscalls;
// -ttfb needs neither.
// Everything listens on 127.0.0.1.
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"strconv"
	"strings"
	"time"
)

type options struct {
	bin      string
	compare  string
	duration time.Duration
	warmup   time.Duration
	reps     int
	conns    []int
	threads  int
	syscalls bool
	sse      int           // events per streamed response; 0: small JSON answers
	sseGap   time.Duration // pause before each event, as an engine decoding
	out      string
	// -ttfb: the added time to first byte of a KV-exact chat request.
	ttfb         bool
	ttfbRequests int
	tokenizers   string
	// daemonEnv is added to every daemon's environment (GODEBUG=gctrace=1,
	// GOGC=...) and daemonLog, when set, is a directory that receives each
	// daemon's whole output, so a tail-latency hunt can read its GC trace.
	daemonEnv []string
	daemonLog string
	// compareEnv is added to the compare daemon's environment only, after
	// daemonEnv: -bin X -compare X -compare-env GOGC=off measures what
	// one runtime setting changes, in the same loop.
	compareEnv []string
}

func main() {
	o, err := parseFlags(os.Args[1:])
	if err != nil {
		fmt.Fprintln(os.Stderr, "proxybench:", err)
		os.Exit(2)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	if err := run(ctx, o); err != nil {
		fmt.Fprintln(os.Stderr, "proxybench:", err)
		os.Exit(1)
	}
}

func parseFlags(args []string) (options, error) {
	fs := flag.NewFlagSet("proxybench", flag.ContinueOnError)
	var o options
	conns := fs.String("conns", "8,64,256", "comma-separated wrk connection counts")
	fs.StringVar(&o.bin, "bin", "bin/loxilb", "daemon binary under test")
	fs.StringVar(&o.compare, "compare", "", "a second daemon binary, measured as the contender \"compare\" in the same run")
	fs.DurationVar(&o.duration, "duration", 5*time.Second, "wrk duration of one run")
	fs.DurationVar(&o.warmup, "warmup", time.Second, "wrk warm-up per contender before the measured runs")
	fs.IntVar(&o.reps, "reps", 3, "interleaved repetitions (the table gives the median)")
	fs.IntVar(&o.threads, "threads", 2, "wrk threads (at most the connection count)")
	fs.BoolVar(&o.syscalls, "syscalls", false, "also count system calls per request of each proxy with strace -c")
	fs.IntVar(&o.sse, "sse", 0, "answer every request with an event stream of this many events, each flushed (CPU per chunk is reported)")
	fs.DurationVar(&o.sseGap, "sse-gap", time.Millisecond, "with -sse, the pause before each event, so each crosses the proxy on its own as decoded tokens do")
	fs.StringVar(&o.out, "out", "", "also write the table (markdown) to this file")
	fs.BoolVar(&o.ttfb, "ttfb", false, "instead: the time a KV-exact rule adds to a 2k-token chat request's time to first byte (VIP vs the vLLM emulator directly)")
	fs.IntVar(&o.ttfbRequests, "ttfb-requests", 200, "with -ttfb, requests per target and body kind in each repetition")
	fs.StringVar(&o.tokenizers, "tokenizers", "", "with -ttfb, the staged tokenizers (default: the repository's testdata/tokenizers)")
	denv := fs.String("daemon-env", "", "comma-separated NAME=VALUE pairs added to every daemon's environment (e.g. GODEBUG=gctrace=1)")
	cenv := fs.String("compare-env", "", "comma-separated NAME=VALUE pairs added to the compare daemon's environment only")
	fs.StringVar(&o.daemonLog, "daemon-log", "", "write each daemon's whole output (its GC trace, say) to DIR/NAME.log")
	if err := fs.Parse(args); err != nil {
		return o, err
	}
	var err error
	if o.daemonEnv, err = envPairs("-daemon-env", *denv); err != nil {
		return o, err
	}
	if o.compareEnv, err = envPairs("-compare-env", *cenv); err != nil {
		return o, err
	}
	for _, f := range strings.Split(*conns, ",") {
		n, err := strconv.Atoi(strings.TrimSpace(f))
		if err != nil || n < 1 {
			return o, fmt.Errorf("-conns %q: want positive integers", *conns)
		}
		o.conns = append(o.conns, n)
	}
	if o.reps < 1 || o.duration < time.Second || o.threads < 1 || o.sse < 0 || o.ttfbRequests < 1 {
		return o, fmt.Errorf("-reps >= 1, -duration >= 1s, -threads >= 1, -sse >= 0 and -ttfb-requests >= 1 please")
	}
	return o, nil
}

// envPairs splits a flag's comma-separated NAME=VALUE pairs.
func envPairs(flagName, v string) ([]string, error) {
	var out []string
	for _, kv := range strings.Split(v, ",") {
		if kv = strings.TrimSpace(kv); kv == "" {
			continue
		}
		if k, _, ok := strings.Cut(kv, "="); !ok || k == "" {
			return nil, fmt.Errorf("%s %q: want NAME=VALUE pairs", flagName, v)
		}
		out = append(out, kv)
	}
	return out, nil
}

func run(ctx context.Context, o options) error {
	if o.daemonLog != "" {
		if err := os.MkdirAll(o.daemonLog, 0o755); err != nil {
			return err
		}
	}
	if o.ttfb {
		return runTTFB(ctx, o)
	}
	for _, tool := range []string{"wrk", "haproxy"} {
		if _, err := exec.LookPath(tool); err != nil {
			return fmt.Errorf("%s not found (apt-get install %s)", tool, tool)
		}
	}
	if o.syscalls {
		if _, err := exec.LookPath("strace"); err != nil {
			return fmt.Errorf("-syscalls needs strace (apt-get install strace)")
		}
	}
	dir, err := os.MkdirTemp("", "proxybench")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	script := filepath.Join(dir, "post.lua")
	if err := os.WriteFile(script, []byte(wrkScript), 0o600); err != nil {
		return err
	}

	backend, err := startBackend(o.sse, o.sseGap)
	if err != nil {
		return err
	}
	defer backend.Close()
	cs := []*contender{{name: "direct", addr: backend.Addr().String()}}
	bins := []struct{ name, path string }{{"loxilb", o.bin}}
	if o.compare != "" {
		bins = append(bins, struct{ name, path string }{"compare", o.compare})
	}
	for _, b := range bins {
		d, err := startDaemon(ctx, b.path, filepath.Join(dir, b.name), backend.Addr().String(), o.runFor(b.name))
		if err != nil {
			return fmt.Errorf("%s: %w", b.name, err)
		}
		defer d.stop()
		cs = append(cs, &contender{name: b.name, addr: d.vip, pid: d.cmd.Process.Pid})
	}
	h, err := startHAProxy(ctx, dir, backend.Addr().String())
	if err != nil {
		return err
	}
	defer h.stop()
	cs = append(cs, &contender{name: "haproxy", addr: h.addr, pid: h.cmd.Process.Pid})

	for _, c := range cs {
		if _, err := runWrk(ctx, script, c.addr, o.threads, 64, o.warmup); err != nil {
			return fmt.Errorf("warm-up of %s: %w", c.name, err)
		}
	}
	res := map[key][]sample{}
	for rep := range o.reps {
		for _, n := range o.conns {
			for k := range cs {
				c := cs[(k+rep)%len(cs)]
				cpu0, sw0 := procCPU(c.pid), procSwitches(c.pid)
				w, err := runWrk(ctx, script, c.addr, min(o.threads, n), n, o.duration)
				if err != nil {
					return fmt.Errorf("%s at %d connections: %w", c.name, n, err)
				}
				s := sample{wrk: w}
				if c.pid != 0 && w.requests > 0 {
					s.cpuPerReq = float64((procCPU(c.pid) - cpu0).Microseconds()) / float64(w.requests)
					s.wakesPerReq = float64(procSwitches(c.pid)-sw0) / float64(w.requests)
				}
				res[key{c.name, n}] = append(res[key{c.name, n}], s)
				fmt.Fprintf(os.Stderr, "rep %d  %-8s %4d conns  %9.0f req/s  p99 %7.2f ms  cpu %5.1f µs/req  sleeps %.2f/req\n",
					rep+1, c.name, n, w.rps, w.p99.Seconds()*1e3, s.cpuPerReq, s.wakesPerReq)
			}
		}
	}
	sys := map[string]sysCount{}
	if o.syscalls {
		for _, c := range cs {
			if c.pid == 0 {
				continue
			}
			v, detail, err := syscallsPerRequest(ctx, c.pid, script, c.addr, min(o.threads, 64), 64, o.duration)
			if err != nil {
				return fmt.Errorf("strace %s: %w", c.name, err)
			}
			sys[c.name] = sysCount{total: v, detail: detail}
		}
	}
	table := render(o, cs, res, sys)
	fmt.Print(table)
	if o.out != "" {
		return os.WriteFile(o.out, []byte(table), 0o644)
	}
	return nil
}

// contender is one target of the load: a proxy process (pid) or the
// backend itself (pid 0).
type contender struct {
	name, addr string
	pid        int
}

type key struct {
	name  string
	conns int
}

type sample struct {
	wrk         wrkResult
	cpuPerReq   float64 // µs of the proxy process's CPU per request
	wakesPerReq float64 // the proxy's threads' voluntary context switches per request
}
