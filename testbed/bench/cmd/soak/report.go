package main

import (
	"encoding/json"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"time"

	"github.com/loxilb-llm/loxilb/testbed/bench"
)

// Sample is one reading of the daemon.
type Sample struct {
	Phase      string  `json:"phase"` // before, load, peak-guard, after
	AtSeconds  float64 `json:"at_s"`  // since the load started
	RSSKiB     int64   `json:"rss_kib"`
	Goroutines int     `json:"goroutines"`
	Requests   int     `json:"requests"`
	OK         int     `json:"ok"`
}

// Bounds are what the verdict judges against.
type Bounds struct {
	// GoroutineSlack is how many more goroutines than before the load
	// the settled daemon may have (pooled connections, timers).
	GoroutineSlack int `json:"goroutine_slack"`
	// RSSGrowthMiB bounds the settled daemon's RSS above its RSS before
	// the load.
	RSSGrowthMiB int64 `json:"rss_growth_mib"`
	// RSSLimitMiB is the memory guard: above it the daemon is killed and
	// the run fails.
	RSSLimitMiB int64 `json:"rss_limit_mib"`
}

// Span is a reading before the load, its peak, and after the settle.
type Span[T int | int64] struct {
	Before T `json:"before"`
	Peak   T `json:"peak"`
	After  T `json:"after"`
}

// Result is one soak run, as written to soak.json.
type Result struct {
	Started     time.Time          `json:"started"`
	Duration    string             `json:"duration"`
	Elapsed     string             `json:"elapsed"`
	Machine     bench.Machine      `json:"machine"`
	Config      map[string]any     `json:"config"`
	Bounds      Bounds             `json:"bounds"`
	Samples     []Sample           `json:"samples"`
	Requests    Requests           `json:"requests"`
	Publisher   map[string]int     `json:"bad_publisher"`
	Backend     map[string]int     `json:"bad_backend"`
	Daemon      map[string]float64 `json:"daemon_counters,omitempty"`
	RSS         Span[int64]        `json:"rss_kib"`
	Goroutines  Span[int]          `json:"goroutines"`
	DaemonAlive bool               `json:"daemon_alive"`
	DaemonExit  string             `json:"daemon_exit,omitempty"`
	DaemonLog   string             `json:"daemon_log_tail,omitempty"`
	Pass        bool               `json:"pass"`
	Failures    []string           `json:"failures,omitempty"`
}

// summarize fills the before/peak/after figures from the samples.
func (r *Result) summarize() {
	for _, s := range r.Samples {
		r.RSS.Peak = max(r.RSS.Peak, s.RSSKiB)
		r.Goroutines.Peak = max(r.Goroutines.Peak, s.Goroutines)
		switch s.Phase {
		case "before":
			r.RSS.Before, r.Goroutines.Before = s.RSSKiB, s.Goroutines
		case "after":
			r.RSS.After, r.Goroutines.After = s.RSSKiB, s.Goroutines
		}
	}
}

// verdict judges a run: the daemon must be alive, must not have crossed
// the memory guard, and after the load and a settle its goroutines and RSS
// must be back within the bounds of their values before the load. It
// returns the reasons for failing, none for a pass.
func verdict(alive bool, guardTripped bool, before, after *Sample, peakKiB int64, b Bounds) []string {
	var out []string
	if !alive && !guardTripped {
		out = append(out, "daemon died")
	}
	if guardTripped {
		out = append(out, fmt.Sprintf("daemon RSS %d MiB crossed the %d MiB guard and was killed", peakKiB>>10, b.RSSLimitMiB))
	}
	if before == nil || after == nil {
		if alive && !guardTripped {
			out = append(out, "no before/after sample")
		}
		return out
	}
	if after.Goroutines > before.Goroutines+b.GoroutineSlack {
		out = append(out, fmt.Sprintf("goroutine leak: %d after settle, %d before (slack %d)",
			after.Goroutines, before.Goroutines, b.GoroutineSlack))
	}
	if grow := after.RSSKiB - before.RSSKiB; grow > b.RSSGrowthMiB<<10 {
		out = append(out, fmt.Sprintf("RSS growth: %d MiB after settle, %d MiB before (bound +%d MiB)",
			after.RSSKiB>>10, before.RSSKiB>>10, b.RSSGrowthMiB))
	}
	return out
}

func mib(kib int64) string { return fmt.Sprintf("%.1f", float64(kib)/1024) }

// mibOr is mib, or "-" for a reading that was never taken.
func mibOr(kib int64) string {
	if kib == 0 {
		return "-"
	}
	return mib(kib)
}

// countOr is the count, or "-" for a reading that was never taken.
func countOr(n int) string {
	if n == 0 {
		return "-"
	}
	return fmt.Sprint(n)
}

// writeTable prints the samples and the summary.
func (r *Result) writeTable(w io.Writer) {
	fmt.Fprintf(w, "%-8s %8s %10s %11s %9s %8s\n", "phase", "t (s)", "RSS (MiB)", "goroutines", "requests", "ok")
	for _, s := range r.Samples {
		fmt.Fprintf(w, "%-8s %8.0f %10s %11d %9d %8d\n", s.Phase, s.AtSeconds, mib(s.RSSKiB), s.Goroutines, s.Requests, s.OK)
	}
	fmt.Fprintf(w, "\nrequests %d: ok %d, errors %d %v\n", r.Requests.Total, r.Requests.OK, r.Requests.Errors, outcomes(r.Requests.ByOutcome))
	fmt.Fprintf(w, "RSS MiB before %s peak %s after %s; goroutines before %s peak %s after %s\n",
		mibOr(r.RSS.Before), mibOr(r.RSS.Peak), mibOr(r.RSS.After), countOr(r.Goroutines.Before), countOr(r.Goroutines.Peak), countOr(r.Goroutines.After))
	fmt.Fprintf(w, "bad publisher: %v\nbad backend: %v\n", outcomes(r.Publisher), outcomes(r.Backend))
	fmt.Fprintf(w, "daemon alive: %v", r.DaemonAlive)
	if r.DaemonExit != "" {
		fmt.Fprintf(w, " (%s)", r.DaemonExit)
	}
	fmt.Fprintln(w)
	if r.Pass {
		fmt.Fprintln(w, "PASS")
	} else {
		fmt.Fprintf(w, "FAIL: %s\n", strings.Join(r.Failures, "; "))
	}
}

// outcomes renders a count map in a stable order.
func outcomes(m map[string]int) string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	parts := make([]string, len(keys))
	for i, k := range keys {
		parts[i] = fmt.Sprintf("%s=%d", k, m[k])
	}
	return strings.Join(parts, " ")
}

// markdown renders the result as the tables BENCHMARKS.md quotes.
func (r *Result) markdown() string {
	var b strings.Builder
	fmt.Fprintf(&b, "# Soak: %s of mixed load with a bad publisher and a bad backend\n\n", r.Duration)
	fmt.Fprintf(&b, "Started %s, %d CPUs (%s), %s.\n\n", r.Started.Format(time.RFC3339), r.Machine.CPUs, r.Machine.CPUModel, r.Machine.GoVersion)
	verdict := "PASS"
	if !r.Pass {
		verdict = "FAIL: " + strings.Join(r.Failures, "; ")
	}
	fmt.Fprintf(&b, "**%s**\n\n", verdict)
	c := r.Config
	onOff := func(k string) string {
		if v, _ := c[k].(bool); v {
			return "on"
		}
		return "off"
	}
	fmt.Fprintf(&b, "Load: %v clients, at most %v requests/s, %v client deadline, warm-up %v, settle %v. "+
		"Attacks: 2^40-byte and random-size frame headers %s, truncated ZMTP READY %s, endless header line %s. Daemon flags: %q.\n\n",
		c["workers"], c["rate_per_s"], c["req_timeout"], c["warmup"], c["settle"],
		onOff("huge_frame"), onOff("bad_handshake"), onOff("endless_header"), c["daemon_args"])
	b.WriteString("| | before | peak | after settle |\n|---|---|---|---|\n")
	fmt.Fprintf(&b, "| daemon RSS (MiB) | %s | %s | %s |\n", mibOr(r.RSS.Before), mibOr(r.RSS.Peak), mibOr(r.RSS.After))
	fmt.Fprintf(&b, "| goroutines | %s | %s | %s |\n\n", countOr(r.Goroutines.Before), countOr(r.Goroutines.Peak), countOr(r.Goroutines.After))
	fmt.Fprintf(&b, "Bounds: goroutines after <= before + %d; RSS after <= before + %d MiB; RSS guard %d MiB.\n\n",
		r.Bounds.GoroutineSlack, r.Bounds.RSSGrowthMiB, r.Bounds.RSSLimitMiB)
	fmt.Fprintf(&b, "Requests: %d, ok %d, errors %d (%s). OK latency p50 %.0f ms, p99 %.0f ms.\n\n",
		r.Requests.Total, r.Requests.OK, r.Requests.Errors, outcomes(r.Requests.ByOutcome), r.Requests.OKLatency.P50, r.Requests.OKLatency.P99)
	b.WriteString("| kind | outcomes |\n|---|---|\n")
	for _, k := range kinds {
		if m := r.Requests.ByKind[k]; m != nil {
			fmt.Fprintf(&b, "| %s | %s |\n", k, outcomes(m))
		}
	}
	fmt.Fprintf(&b, "\nBad publisher: %s.\n\nBad backend: %s.\n\n", outcomes(r.Publisher), outcomes(r.Backend))
	if len(r.Daemon) > 0 {
		keys := make([]string, 0, len(r.Daemon))
		for k := range r.Daemon {
			keys = append(keys, k)
		}
		sort.Strings(keys)
		b.WriteString("Daemon counters at the end:")
		for i, k := range keys {
			sep := ","
			if i == 0 {
				sep = ""
			}
			fmt.Fprintf(&b, "%s %s %.0f", sep, k, r.Daemon[k])
		}
		b.WriteString(".\n\n")
	}
	b.WriteString("| phase | t (s) | RSS (MiB) | goroutines | requests | ok |\n|---|---|---|---|---|---|\n")
	for _, s := range r.Samples {
		fmt.Fprintf(&b, "| %s | %.0f | %s | %d | %d | %d |\n", s.Phase, s.AtSeconds, mib(s.RSSKiB), s.Goroutines, s.Requests, s.OK)
	}
	if !r.DaemonAlive {
		fmt.Fprintf(&b, "\nThe daemon died (%s). Its output before and at its end:\n\n```\n%s\n```\n", r.DaemonExit, r.DaemonLog)
	}
	return b.String()
}

// writeFiles writes soak.json and soak.md into dir.
func (r *Result) writeFiles(dir string) error {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	j, err := json.MarshalIndent(r, "", "  ")
	if err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(dir, "soak.json"), append(j, '\n'), 0o644); err != nil {
		return err
	}
	return os.WriteFile(filepath.Join(dir, "soak.md"), []byte(r.markdown()), 0o644)
}
