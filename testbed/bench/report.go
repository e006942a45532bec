package bench

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"text/tabwriter"
	"time"
)

// Percentiles of a latency distribution, in milliseconds.
type Percentiles struct {
	Mean float64 `json:"mean,omitempty"`
	P50  float64 `json:"p50"`
	P90  float64 `json:"p90"`
	P99  float64 `json:"p99"`
}

// ArmResult is one arm's outcome on one workload.
type ArmResult struct {
	Arm   string `json:"arm"`
	Label string `json:"label"`
	// Runs is how many repetitions the figures are the median of;
	// Requests, Errors, Spills and Tiers are totals over them.
	Runs     int `json:"runs"`
	Requests int `json:"requests"`
	Errors   int `json:"errors"`
	// FirstError is the first failure seen, for diagnosis.
	FirstError string `json:"first_error,omitempty"`
	// HitRatio is hit_tokens/prompt_tokens summed over the engines' own
	// counters (deltas of GET /sim/stats over the arm).
	HitRatio     float64 `json:"hit_ratio"`
	HitTokens    uint64  `json:"hit_tokens"`
	PromptTokens uint64  `json:"prompt_tokens"`
	// OfBound is HitRatio / Bound.FleetLRU.
	OfBound float64 `json:"of_upper_bound"`
	// TTFTms is time to the first streamed chunk at the client: queueing,
	// the modelled prefill of the uncached tokens, one decode step, and the
	// gateway's own work.
	TTFTms Percentiles `json:"ttft_ms"`
	// TTFTLaterTurnsMs is TTFT over the requests that are not the first
	// turn of a chat session (nil for workloads without sessions). A first
	// turn's history is new wherever it goes; later turns can hit their
	// session's history, so this is the part of TTFT routing controls.
	// TTFTms still covers every request.
	TTFTLaterTurnsMs *Percentiles `json:"ttft_later_turns_ms,omitempty"`
	E2Ems            Percentiles  `json:"e2e_ms"`
	ThroughputRPS    float64      `json:"throughput_rps"`
	OutputTokPerSec  float64      `json:"output_tok_per_sec"`
	WallSeconds      float64      `json:"wall_seconds"`
	// PerEndpoint is requests served by each engine (its own counter).
	PerEndpoint []int `json:"requests_per_endpoint"`
	// PerNode is requests each gateway node proxied (several nodes only).
	PerNode []int `json:"requests_per_node,omitempty"`
	// Cold is requests whose receipt matched no block (each computed its
	// whole prompt unless it waited for a sibling), summed over runs.
	Cold int `json:"cold_requests"`
	// DuplicateLeaders and TieYielded sum the nodes'
	// loxilb_cluster_prefill_duplicate_leaders_total and
	// loxilb_cluster_prefill_tiebreak_total{outcome="yielded"} over runs
	// (several nodes only).
	DuplicateLeaders int `json:"duplicate_leaders,omitempty"`
	TieYielded       int `json:"tiebreak_yielded,omitempty"`
	// LoadSnapshots sums the nodes' loxilb_cluster_load_received_total
	// over runs: the other nodes' in-flight counts each node took
	// (several nodes only; 0 with a build or setting that shares none).
	LoadSnapshots   int     `json:"load_snapshots_received,omitempty"`
	MaxOverMeanLoad float64 `json:"max_over_mean_load"`
	// EndpointsPerGroup is the mean number of distinct endpoints a prefix
	// group (burst, session, shared prefix) was routed to, from receipts.
	EndpointsPerGroup float64        `json:"endpoints_per_group"`
	Tiers             map[string]int `json:"receipt_tiers"`
	Spills            int            `json:"spills"`
	// PrefillBudgets is the prefill admission budget the daemon applied to
	// each endpoint at the end of the arm ("2 observed": slots and
	// source), PrefillQueued how many requests waited for a slot (summed
	// over runs). KV arms only.
	PrefillBudgets []string `json:"prefill_budgets,omitempty"`
	PrefillQueued  int      `json:"prefill_queued,omitempty"`
	// HitRatioRuns and TTFTP90Runs are the per-run values behind the
	// medians.
	HitRatioRuns []float64 `json:"hit_ratio_runs"`
	TTFTP90Runs  []float64 `json:"ttft_p90_ms_runs"`
	// TTFTLaterTurnsP90Runs is the per-run TTFT p90 of later turns.
	TTFTLaterTurnsP90Runs []float64 `json:"ttft_later_turns_p90_ms_runs,omitempty"`
	// MaxOverMeanRuns is the per-run max/mean load; the load target is
	// checked against its worst run.
	MaxOverMeanRuns []float64 `json:"max_over_mean_load_runs,omitempty"`
}

// worstLoad is the highest per-run max/mean load, or the median when the
// runs were not recorded.
func (a *ArmResult) worstLoad() float64 {
	w := a.MaxOverMeanLoad
	for _, v := range a.MaxOverMeanRuns {
		w = max(w, v)
	}
	return w
}

// WorkloadResult is one workload under every arm.
type WorkloadResult struct {
	Workload Workload    `json:"workload"`
	Requests int         `json:"requests"`
	Bound    Bound       `json:"upper_bound"`
	Arms     []ArmResult `json:"arms"`
}

// Arm returns the named arm's result, or nil.
func (w *WorkloadResult) Arm(name string) *ArmResult {
	for i := range w.Arms {
		if w.Arms[i].Arm == name {
			return &w.Arms[i]
		}
	}
	return nil
}

// Machine describes where the run happened.
type Machine struct {
	CPUs      int    `json:"nproc"`
	CPUModel  string `json:"cpu_model"`
	Kernel    string `json:"kernel"`
	GoVersion string `json:"go"`
	OS        string `json:"os"`
}

// Report is a whole run.
type Report struct {
	Suite     Suite            `json:"suite"`
	Machine   Machine          `json:"machine"`
	Started   time.Time        `json:"started"`
	Elapsed   string           `json:"elapsed"`
	Workloads []WorkloadResult `json:"workloads"`
	Targets   []TargetResult   `json:"targets"`
}

// TargetResult is one acceptance target and whether the run met it.
type TargetResult struct {
	Workload string `json:"workload"`
	Arm      string `json:"arm"`
	Target   string `json:"target"`
	Value    string `json:"value"`
	Pass     bool   `json:"pass"`
}

// Workload names of the default suite the targets refer to.
const (
	WShared40  = "shared-prefix-40"
	WShared100 = "shared-prefix-100"
	WMultiTurn = "multi-turn"
	// WMultiTurnLong is WMultiTurn with 16 turns per session.
	WMultiTurnLong = "multi-turn-long"
	// WMultiTurnShort has no per-user context: a request's cached history
	// is short next to its new turn, which bounds what routing can save.
	WMultiTurnShort = "multi-turn-no-context"
	WSiblings       = "sibling-bursts"
	WHotPrefix      = "hot-prefix"
	// Chat-path workloads (/v1/chat/completions, the model's template).
	WDocQA           = "doc-qa"
	WDocQAMixed      = "doc-qa-mixed"       // half the requests one-shot prompts
	WDocQAMixedHeavy = "doc-qa-mixed-heavy" // the same at a higher rate
	WAgentLoop       = "agent-loop"
)

// CheckTargets evaluates the acceptance targets on whatever workloads and
// arms the report holds: for the product-default KV-exact arm ("kv"), and
// for the tuned-blend arm when present, for comparison.
func CheckTargets(r *Report) []TargetResult {
	var out []TargetResult
	for i := range r.Workloads {
		w := &r.Workloads[i]
		rr := w.Arm(ArmRR.Name)
		for _, name := range []string{ArmKV.Name, ArmKVLoad.Name} {
			kv := w.Arm(name)
			if kv == nil {
				continue
			}
			if rr != nil && kv.TTFTms.P50 > 0 {
				out = append(out, TargetResult{Workload: w.Workload.Name, Arm: name, Target: "TTFT p50/p90/p99 no worse than round robin",
					Value: fmt.Sprintf("%.0f/%.0f/%.0f ms vs %.0f/%.0f/%.0f ms", kv.TTFTms.P50, kv.TTFTms.P90, kv.TTFTms.P99, rr.TTFTms.P50, rr.TTFTms.P90, rr.TTFTms.P99),
					Pass:  kv.TTFTms.P50 <= rr.TTFTms.P50 && kv.TTFTms.P90 <= rr.TTFTms.P90 && kv.TTFTms.P99 <= rr.TTFTms.P99})
			}
			switch w.Workload.Name {
			case WDocQA, WDocQAMixed, WDocQAMixedHeavy, WAgentLoop:
				out = append(out, TargetResult{Workload: w.Workload.Name, Arm: name, Target: "hit ratio >= 90% of the fleet-LRU bound",
					Value: fmt.Sprintf("%.3f / %.3f = %.0f%%", kv.HitRatio, w.Bound.FleetLRU, 100*kv.OfBound), Pass: kv.OfBound >= 0.9})
			case WShared100, WMultiTurn, WMultiTurnLong:
				out = append(out, TargetResult{Workload: w.Workload.Name, Arm: name, Target: "hit ratio >= 90% of the fleet-LRU bound",
					Value: fmt.Sprintf("%.3f / %.3f = %.0f%%", kv.HitRatio, w.Bound.FleetLRU, 100*kv.OfBound), Pass: kv.OfBound >= 0.9})
				if rr != nil && kv.TTFTms.P90 > 0 {
					x := rr.TTFTms.P90 / kv.TTFTms.P90
					best := 0.0
					if w.Bound.TTFTFloorMs.P90 > 0 {
						best = rr.TTFTms.P90 / w.Bound.TTFTFloorMs.P90
					}
					v := fmt.Sprintf("%.0f ms vs %.0f ms = %.1fx; at the no-queueing floor (p90 %.0f ms) it would be %.1fx",
						kv.TTFTms.P90, rr.TTFTms.P90, x, w.Bound.TTFTFloorMs.P90, best)
					if kv.TTFTLaterTurnsMs != nil && rr.TTFTLaterTurnsMs != nil && kv.TTFTLaterTurnsMs.P90 > 0 {
						v += fmt.Sprintf("; later turns only (not judged): %.0f ms vs %.0f ms = %.1fx",
							kv.TTFTLaterTurnsMs.P90, rr.TTFTLaterTurnsMs.P90, rr.TTFTLaterTurnsMs.P90/kv.TTFTLaterTurnsMs.P90)
					}
					out = append(out, TargetResult{Workload: w.Workload.Name, Arm: name, Target: "TTFT p90 >= 5x better than round robin",
						Value: v, Pass: x >= 5})
				}
			case WHotPrefix:
				out = append(out, TargetResult{Workload: w.Workload.Name, Arm: name, Target: "no endpoint above 2x mean load (spill relief on)",
					Value: fmt.Sprintf("max/mean %.2f in the worst run (median %.2f; median run %v)", kv.worstLoad(), kv.MaxOverMeanLoad, kv.PerEndpoint),
					Pass:  kv.worstLoad() <= 2})
			}
		}
	}
	return out
}

// DescribeMachine reads nproc, the CPU model and the kernel release.
func DescribeMachine() Machine {
	m := Machine{CPUs: runtime.NumCPU(), GoVersion: runtime.Version(), OS: runtime.GOOS + "/" + runtime.GOARCH}
	if f, err := os.Open("/proc/cpuinfo"); err == nil {
		sc := bufio.NewScanner(f)
		for sc.Scan() {
			if k, v, ok := strings.Cut(sc.Text(), ":"); ok && strings.TrimSpace(k) == "model name" {
				m.CPUModel = strings.TrimSpace(v)
				break
			}
		}
		f.Close()
	}
	if b, err := os.ReadFile("/proc/sys/kernel/osrelease"); err == nil {
		m.Kernel = strings.TrimSpace(string(b))
	} else if out, err := exec.Command("uname", "-r").Output(); err == nil {
		m.Kernel = strings.TrimSpace(string(out))
	}
	return m
}

// WriteFiles writes report.json and one SVG chart per workload into dir.
func (r *Report) WriteFiles(dir string) error {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	b, err := json.MarshalIndent(r, "", "  ")
	if err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(dir, "report.json"), append(b, '\n'), 0o644); err != nil {
		return err
	}
	for i := range r.Workloads {
		svg := Chart(&r.Workloads[i], r.Suite.Fleet)
		if err := os.WriteFile(filepath.Join(dir, r.Workloads[i].Workload.Name+".svg"), []byte(svg), 0o644); err != nil {
			return err
		}
	}
	return nil
}

func floats(v []float64) string {
	s := make([]string, len(v))
	for i, x := range v {
		s[i] = fmt.Sprintf("%.0f", x)
	}
	return strings.Join(s, "/")
}

// WriteTable prints the report as text tables.
func (r *Report) WriteTable(w io.Writer) {
	f := r.Suite.Fleet
	fmt.Fprintf(w, "fleet: %s of %d tokens (%d tokens total), prefill %.0f us/uncached token, decode %.0f ms/step, %d running/engine, time scale %g\n",
		f.Describe(), f.BlockSize, f.TotalBlocks()*f.BlockSize, f.PrefillUsPerToken, f.DecodeUsPerToken/1000, f.MaxRunning, f.TimeScale)
	fmt.Fprintf(w, "machine: %d CPUs, %s, kernel %s; seed %d; figures are medians of %d run(s) per arm\n",
		r.Machine.CPUs, r.Machine.CPUModel, r.Machine.Kernel, r.Suite.Seed, r.Suite.runs())
	for _, a := range r.Suite.Arms {
		env := "default daemon settings"
		if len(a.Env) > 0 {
			env = strings.Join(a.Env, " ")
		}
		fmt.Fprintf(w, "arm %s: %s; %s\n", a.Name, a.Label, env)
	}
	for _, wr := range r.Workloads {
		fmt.Fprintf(w, "\n== %s: %s\n   %s\n   upper bound (one LRU cache of the fleet's capacity): %.3f   (unbounded cache: %.3f)\n",
			wr.Workload.Name, wr.Workload.Title, wr.Workload.Description, wr.Bound.FleetLRU, wr.Bound.Unbounded)
		fmt.Fprintf(w, "   TTFT floor with those hits and no queueing: p50 %.1f ms, p90 %.1f ms, p99 %.1f ms\n",
			wr.Bound.TTFTFloorMs.P50, wr.Bound.TTFTFloorMs.P90, wr.Bound.TTFTFloorMs.P99)
		later := wr.Bound.TTFTFloorLaterTurnsMs != nil
		if later {
			fmt.Fprintf(w, "   later turns only (%d of %d requests; first turns are cold wherever they go): floor p90 %.1f ms\n",
				wr.Bound.LaterTurns, wr.Requests, wr.Bound.TTFTFloorLaterTurnsMs.P90)
		}
		tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
		head := "arm\thit ratio\tof bound\tTTFT p50 ms\tp90 ms\tp99 ms\t"
		if later {
			head += "later-turn p90 ms\t"
		}
		fmt.Fprintln(tw, head+"req/s\tper-endpoint requests\tmax/mean\teps/group\tspills\terrors\tp90 per run\t")
		for _, a := range wr.Arms {
			fmt.Fprintf(tw, "%s\t%.3f\t%.0f%%\t%.1f\t%.1f\t%.1f\t", a.Arm, a.HitRatio, 100*a.OfBound, a.TTFTms.P50, a.TTFTms.P90, a.TTFTms.P99)
			if later {
				v := 0.0
				if a.TTFTLaterTurnsMs != nil {
					v = a.TTFTLaterTurnsMs.P90
				}
				fmt.Fprintf(tw, "%.1f\t", v)
			}
			fmt.Fprintf(tw, "%.1f\t%v\t%.2f\t%.2f\t%d\t%d\t%s\t\n", a.ThroughputRPS, a.PerEndpoint, a.MaxOverMeanLoad, a.EndpointsPerGroup, a.Spills, a.Errors, floats(a.TTFTP90Runs))
		}
		tw.Flush()
		for _, a := range wr.Arms {
			if a.PrefillBudgets != nil {
				fmt.Fprintf(w, "   %s prefill budgets per endpoint (slots source): %s; %d requests queued in the gateway\n", a.Arm, strings.Join(a.PrefillBudgets, ", "), a.PrefillQueued)
			}
			if a.PerNode != nil {
				fmt.Fprintf(w, "   %s requests per gateway node: %v; %d cold requests, %d duplicate leaders seen, %d tie-break yields, %d load snapshots received (over %d runs)\n",
					a.Arm, a.PerNode, a.Cold, a.DuplicateLeaders, a.TieYielded, a.LoadSnapshots, a.Runs)
			}
		}
		for _, a := range wr.Arms {
			if a.FirstError != "" {
				fmt.Fprintf(w, "   %s first error: %s\n", a.Arm, a.FirstError)
			}
		}
	}
	if len(r.Targets) > 0 {
		fmt.Fprintln(w, "\ntargets:")
		for _, t := range r.Targets {
			v := "MISSED"
			if t.Pass {
				v = "met"
			}
			fmt.Fprintf(w, "  [%s] %s, arm %s: %s (%s)\n", v, t.Workload, t.Arm, t.Target, t.Value)
		}
	}
}
