// Command hotpath runs the hot-path micro-benchmarks of the request and
// event paths (tokenize, hash, inventory apply and query, routing decision,
// proxy overhead) with `go test -bench` and prints them as one table.
package main

import (
	"bufio"
	"bytes"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"regexp"
	"strconv"
	"strings"
	"text/tabwriter"
)

// stage is one row group: a package and the benchmarks that measure it.
type stage struct {
	name, pkg, pattern, note string
}

var stages = []stage{
	{"tokenize", "./pkg/tokenizer", "^(BenchmarkEncodePrompt|BenchmarkEncodeRequestChat)$", ""},
	{"hash", "./pkg/blockhash", "^BenchmarkKeys$", "256 blocks x 16 tokens per op"},
	{"inventory apply", "./pkg/kvevents", "^BenchmarkDecodeApply$", "msgpack batch decode + filter + index apply"},
	{"inventory apply", "./pkg/kvindex", "^BenchmarkApply$", "Store/Remove of block batches"},
	{"inventory query", "./pkg/kvindex", "^BenchmarkPrefixMatch$", "256-block request vs 64 endpoints"},
	{"routing decision", "./pkg/router", "^BenchmarkDecideKVIndex$", "lookup + score, 64 endpoints"},
	{"routing decision", "./pkg/gateway", "^BenchmarkRoutingDecisionChat2k(New|NextTurn)?$", ""},
	{"proxy overhead", "./pkg/proxy", "^BenchmarkThroughput$", "keep-alive clients: direct vs through the proxy"},
}

// notes describe benchmarks whose stage holds several kinds.
var notes = map[string]string{
	"EncodePrompt":                  "~2k-token prompt, BPE only",
	"EncodeRequestChat":             "chat request: template render + tokenize",
	"RoutingDecisionChat2kNextTurn": "2k-token chat, next turn of one conversation: parse + render + tokenize + hash + lookup + decide",
	"RoutingDecisionChat2kNew":      "2k-token chat, a new prompt each time",
	"RoutingDecisionChat2k":         "2k-token chat, the same body each time",
}

// noteFor returns the note of the longest prefix of name in notes.
func noteFor(st stage, name string) string {
	note, best := st.note, 0
	for prefix, n := range notes {
		if strings.HasPrefix(name, prefix) && len(prefix) > best {
			note, best = n, len(prefix)
		}
	}
	return note
}

var line = regexp.MustCompile(`^(Benchmark\S+?)(?:-\d+)?\s+(\d+)\s+(.*)$`)

type result struct {
	stage, name, note string
	metrics           [][2]string // value, unit
}

func main() {
	benchtime := flag.String("benchtime", "300ms", "go test -benchtime per benchmark")
	only := flag.String("stage", "", "run only stages whose name contains this")
	flag.Parse()
	var results []result
	failed := false
	for _, st := range stages {
		if *only != "" && !strings.Contains(st.name, *only) {
			continue
		}
		fmt.Fprintf(os.Stderr, "bench %-17s %s %s\n", st.name, st.pkg, st.pattern)
		cmd := exec.Command("go", "test", "-run", "^$", "-bench", st.pattern, "-benchmem", "-count", "1",
			"-benchtime", *benchtime, st.pkg)
		var out bytes.Buffer
		cmd.Stdout, cmd.Stderr = &out, &out
		if err := cmd.Run(); err != nil {
			fmt.Fprintf(os.Stderr, "%s: %v\n%s", st.pkg, err, out.String())
			failed = true
			continue
		}
		n := 0
		sc := bufio.NewScanner(&out)
		for sc.Scan() {
			m := line.FindStringSubmatch(sc.Text())
			if m == nil {
				continue
			}
			f := strings.Fields(m[3])
			name := strings.TrimPrefix(m[1], "Benchmark")
			r := result{stage: st.name, name: name, note: noteFor(st, name)}
			for i := 0; i+1 < len(f); i += 2 {
				r.metrics = append(r.metrics, [2]string{f[i], f[i+1]})
			}
			results = append(results, r)
			n++
		}
		if n == 0 {
			fmt.Fprintf(os.Stderr, "%s: no benchmark matched %s\n%s", st.pkg, st.pattern, out.String())
			failed = true
		}
	}
	tw := tabwriter.NewWriter(os.Stdout, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "STAGE\tBENCHMARK\tTIME/OP\tB/OP\tALLOCS/OP\tOTHER\tWHAT")
	for _, r := range results {
		var t, bop, allocs string
		var other []string
		for _, m := range r.metrics {
			switch m[1] {
			case "ns/op":
				t = human(m[0])
			case "B/op":
				bop = m[0]
			case "allocs/op":
				allocs = m[0]
			default:
				other = append(other, m[0]+" "+m[1])
			}
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\t%s\n", r.stage, r.name, t, bop, allocs, strings.Join(other, ", "), r.note)
	}
	tw.Flush()
	if failed {
		os.Exit(1)
	}
}

// human prints ns/op in the unit that keeps it short.
func human(ns string) string {
	v, err := strconv.ParseFloat(ns, 64)
	if err != nil {
		return ns
	}
	switch {
	case v >= 1e6:
		return fmt.Sprintf("%.2f ms", v/1e6)
	case v >= 1e3:
		return fmt.Sprintf("%.2f µs", v/1e3)
	default:
		return fmt.Sprintf("%.0f ns", v)
	}
}
