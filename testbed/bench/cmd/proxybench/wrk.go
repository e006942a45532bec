package main

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// reqBody is the small completion request every run sends.
const reqBody = `{"model":"m","prompt":"hello","max_tokens":1}`

// wrkScript makes every wrk request a keep-alive POST of reqBody.
var wrkScript = fmt.Sprintf(`wrk.method = "POST"
wrk.body = %q
wrk.headers["Content-Type"] = "application/json"
`, reqBody)

// wrkResult is what one wrk run measured.
type wrkResult struct {
	requests int64
	rps      float64
	p50, p99 time.Duration
}

// runWrk runs wrk against addr for d with n connections.
func runWrk(ctx context.Context, script, addr string, threads, n int, d time.Duration) (wrkResult, error) {
	secs := strconv.Itoa(max(1, int(d.Round(time.Second).Seconds())))
	cmd := exec.CommandContext(ctx, "wrk", "-t", strconv.Itoa(threads), "-c", strconv.Itoa(n), "-d", secs+"s",
		"--latency", "--timeout", "10s", "-s", script, "http://"+addr+"/v1/completions")
	var out, errb bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errb
	if err := cmd.Run(); err != nil {
		return wrkResult{}, fmt.Errorf("wrk: %w: %s%s", err, out.String(), errb.String())
	}
	return parseWrk(out.String())
}

var (
	reqLine    = regexp.MustCompile(`(?m)^\s*(\d+) requests in `)
	rpsLine    = regexp.MustCompile(`(?m)^Requests/sec:\s+([0-9.]+)`)
	pctLine    = regexp.MustCompile(`(?m)^\s+(50|99)%\s+([0-9.]+)(us|ms|s|m)\s*$`)
	socketLine = regexp.MustCompile(`(?m)^\s*Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)`)
	non2xxLine = regexp.MustCompile(`(?m)^\s*Non-2xx or 3xx responses: (\d+)`)
)

// parseWrk reads wrk's --latency report. A run with non-2xx answers or
// socket errors is an error: a proxy failing fast must not look fast.
func parseWrk(s string) (wrkResult, error) {
	var r wrkResult
	m := reqLine.FindStringSubmatch(s)
	k := rpsLine.FindStringSubmatch(s)
	if m == nil || k == nil {
		return r, fmt.Errorf("unexpected wrk output:\n%s", s)
	}
	r.requests, _ = strconv.ParseInt(m[1], 10, 64)
	r.rps, _ = strconv.ParseFloat(k[1], 64)
	for _, p := range pctLine.FindAllStringSubmatch(s, -1) {
		v, _ := strconv.ParseFloat(p[2], 64)
		unit := map[string]time.Duration{"us": time.Microsecond, "ms": time.Millisecond, "s": time.Second, "m": time.Minute}[p[3]]
		d := time.Duration(v * float64(unit))
		if p[1] == "50" {
			r.p50 = d
		} else {
			r.p99 = d
		}
	}
	if r.p99 == 0 {
		return r, fmt.Errorf("no latency distribution in wrk output:\n%s", s)
	}
	if e := socketLine.FindStringSubmatch(s); e != nil {
		for _, f := range e[1:] {
			if f != "0" {
				return r, fmt.Errorf("wrk saw socket errors (%s):\n%s", strings.TrimSpace(e[0]), s)
			}
		}
	}
	if e := non2xxLine.FindStringSubmatch(s); e != nil {
		return r, fmt.Errorf("%s non-2xx answers:\n%s", e[1], s)
	}
	return r, nil
}

// procCPU returns the user+system CPU time a process has used so far,
// from /proc/PID/stat in clock ticks (USER_HZ, 100 on Linux).
func procCPU(pid int) time.Duration {
	if pid == 0 {
		return 0
	}
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0
	}
	// utime and stime are the 14th and 15th fields; the command name in
	// parentheses may hold spaces, so count from its closing parenthesis.
	i := bytes.LastIndexByte(b, ')')
	if i < 0 {
		return 0
	}
	f := strings.Fields(string(b[i+1:]))
	if len(f) < 13 {
		return 0
	}
	ut, err1 := strconv.ParseInt(f[11], 10, 64)
	st, err2 := strconv.ParseInt(f[12], 10, 64)
	if err1 != nil || err2 != nil {
		return 0
	}
	return time.Duration(ut+st) * 10 * time.Millisecond
}

// procSwitches returns how many times the threads of a process have
// given up the CPU to wait (voluntary_ctxt_switches in
// /proc/PID/task/TID/status, summed): every park of a thread on the
// poller, a futex or a sleep counts one, so per request it says how often
// the process sleeps and must be woken, whatever the machine's load
// (involuntary switches, which the load decides, are left out). Threads
// that exited between two readings are missed, which the Go runtime and
// HAProxy rarely do.
func procSwitches(pid int) int64 {
	if pid == 0 {
		return 0
	}
	dirs, err := os.ReadDir(fmt.Sprintf("/proc/%d/task", pid))
	if err != nil {
		return 0
	}
	var total int64
	for _, d := range dirs {
		b, err := os.ReadFile(fmt.Sprintf("/proc/%d/task/%s/status", pid, d.Name()))
		if err != nil {
			continue
		}
		total += statusField(b, "voluntary_ctxt_switches:")
	}
	return total
}

// statusField returns the number after name at the start of a line of a
// /proc status file, or 0.
func statusField(b []byte, name string) int64 {
	for _, line := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, name); ok {
			n, err := strconv.ParseInt(strings.TrimSpace(v), 10, 64)
			if err == nil {
				return n
			}
		}
	}
	return 0
}

// syscallsPerRequest counts the system calls of every thread of pid with
// `strace -c -f` during one wrk run. strace slows the process down, so
// only the count per request means anything, not the rate.
// detail names the largest kinds per request, with the failed ones (a
// read that found nothing is EAGAIN).
func syscallsPerRequest(ctx context.Context, pid int, script, addr string, threads, n int, d time.Duration) (total float64, detail string, err error) {
	out := filepath.Join(os.TempDir(), fmt.Sprintf("proxybench-strace-%d.txt", pid))
	defer os.Remove(out)
	st := exec.CommandContext(ctx, "strace", "-c", "-f", "-o", out, "-p", strconv.Itoa(pid))
	var errb bytes.Buffer
	st.Stderr = &errb
	if err := st.Start(); err != nil {
		return 0, "", err
	}
	time.Sleep(500 * time.Millisecond) // attached to every thread
	w, err := runWrk(ctx, script, addr, threads, n, d)
	_ = st.Process.Signal(syscall.SIGINT)
	_ = st.Wait()
	if err != nil {
		return 0, "", err
	}
	b, rerr := os.ReadFile(out)
	if rerr != nil {
		return 0, "", fmt.Errorf("%w: %s", rerr, errb.String())
	}
	calls, err := straceTotal(string(b))
	if err != nil {
		return 0, "", err
	}
	perReq := float64(w.requests)
	var parts []string
	for i, k := range straceKinds(string(b)) {
		if i == 5 {
			break
		}
		p := fmt.Sprintf("%s %.2f", k.name, float64(k.calls)/perReq)
		if k.errors > 0 {
			p += fmt.Sprintf(" (%.2f failed)", float64(k.errors)/perReq)
		}
		parts = append(parts, p)
	}
	return float64(calls) / perReq, strings.Join(parts, ", "), nil
}

// straceKind is one line of strace -c's table.
type straceKind struct {
	name          string
	calls, errors int64
}

// straceKinds returns the system calls of strace -c's table, most
// frequent first.
func straceKinds(s string) []straceKind {
	var out []straceKind
	sc := bufio.NewScanner(strings.NewReader(s))
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		// % time, seconds, usecs/call, calls, [errors,] syscall
		if len(f) < 5 || f[len(f)-1] == "total" || f[len(f)-1] == "syscall" {
			continue
		}
		calls, err := strconv.ParseInt(f[3], 10, 64)
		if err != nil {
			continue
		}
		k := straceKind{name: f[len(f)-1], calls: calls}
		if len(f) == 6 {
			k.errors, _ = strconv.ParseInt(f[4], 10, 64)
		}
		out = append(out, k)
	}
	sort.SliceStable(out, func(i, j int) bool { return out[i].calls > out[j].calls })
	return out
}

// straceTotal returns the calls column of strace -c's "total" line.
func straceTotal(s string) (int64, error) {
	sc := bufio.NewScanner(strings.NewReader(s))
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		// % time, seconds, usecs/call, calls, [errors,] total
		if len(f) >= 5 && f[len(f)-1] == "total" {
			return strconv.ParseInt(f[3], 10, 64)
		}
	}
	return 0, errors.New("no total line in strace -c output:\n" + s)
}

// procRunDelay is the time pid's threads have spent runnable but waiting
// for a CPU (the second field of /proc/PID/task/TID/schedstat, summed over
// its threads; a thread that exited takes its share with it): the host
// run-queue wait that a Go runtime trace cannot see. 0 when unknown.
func procRunDelay(pid int) time.Duration {
	if pid == 0 {
		return 0
	}
	dir := fmt.Sprintf("/proc/%d/task", pid)
	des, err := os.ReadDir(dir)
	if err != nil {
		return 0
	}
	var sum int64
	for _, de := range des {
		b, err := os.ReadFile(filepath.Join(dir, de.Name(), "schedstat"))
		if err != nil {
			continue
		}
		if f := strings.Fields(string(b)); len(f) >= 2 {
			if v, err := strconv.ParseInt(f[1], 10, 64); err == nil {
				sum += v
			}
		}
	}
	return time.Duration(sum)
}
