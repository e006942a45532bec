package main

import (
	"fmt"
	"runtime"
	"slices"
	"strings"
	"time"
)

// median of xs (the mean of the middle two for an even count).
func median(xs []float64) float64 {
	if len(xs) == 0 {
		return 0
	}
	s := slices.Clone(xs)
	slices.Sort(s)
	if len(s)%2 == 1 {
		return s[len(s)/2]
	}
	return (s[len(s)/2-1] + s[len(s)/2]) / 2
}

// render prints the medians as a markdown table: one row per contender
// and concurrency, with the ratio of its requests/s to HAProxy's.
// sysCount is one proxy's system calls per request and the largest kinds.
type sysCount struct {
	total  float64
	detail string
}

func render(o options, cs []*contender, res map[key][]sample, sys map[string]sysCount) string {
	var b strings.Builder
	fmt.Fprintf(&b, "proxybench: %s wrk runs, %d threads, %d interleaved repetitions (medians), %d CPUs, %s\n\n",
		o.duration, o.threads, o.reps, runtime.NumCPU(), time.Now().UTC().Format(time.RFC3339))
	if o.sse > 0 {
		fmt.Fprintf(&b, "Every answer is an event stream of %d events (chunks).\n\n", o.sse)
		b.WriteString("| conns | contender | req/s | p99 ms | CPU µs/req | CPU µs/chunk | sleeps/req | req/s vs haproxy |\n|---:|---|---:|---:|---:|---:|---:|---:|\n")
	} else {
		b.WriteString("| conns | contender | req/s | p99 ms | CPU µs/req | sleeps/req | req/s vs haproxy |\n|---:|---|---:|---:|---:|---:|---:|\n")
	}
	for _, n := range o.conns {
		hap := medianOf(res[key{"haproxy", n}], func(s sample) float64 { return s.wrk.rps })
		for _, c := range cs {
			ss := res[key{c.name, n}]
			rps := medianOf(ss, func(s sample) float64 { return s.wrk.rps })
			p99 := medianOf(ss, func(s sample) float64 { return s.wrk.p99.Seconds() * 1e3 })
			cpu, chunk, sleeps := "-", "-", "-"
			if c.pid != 0 {
				perReq := medianOf(ss, func(s sample) float64 { return s.cpuPerReq })
				cpu = fmt.Sprintf("%.1f", perReq)
				if o.sse > 0 {
					chunk = fmt.Sprintf("%.2f", perReq/float64(o.sse+1))
				}
				sleeps = fmt.Sprintf("%.2f", medianOf(ss, func(s sample) float64 { return s.wakesPerReq }))
			}
			if o.sse > 0 {
				cpu += " | " + chunk
			}
			cpu += " | " + sleeps
			ratio := "-"
			if hap > 0 && c.name != "haproxy" {
				ratio = fmt.Sprintf("%.2f", rps/hap)
			}
			fmt.Fprintf(&b, "| %d | %s | %.0f | %.2f | %s | %s |\n", n, c.name, rps, p99, cpu, ratio)
		}
	}
	if len(sys) > 0 {
		b.WriteString("\n| contender | syscalls/request (strace -c -f, 64 conns) | most frequent, per request |\n|---|---:|---|\n")
		for _, c := range cs {
			if v, ok := sys[c.name]; ok {
				fmt.Fprintf(&b, "| %s | %.2f | %s |\n", c.name, v.total, v.detail)
			}
		}
	}
	return b.String()
}

func medianOf(ss []sample, f func(sample) float64) float64 {
	xs := make([]float64, len(ss))
	for i, s := range ss {
		xs[i] = f(s)
	}
	return median(xs)
}
