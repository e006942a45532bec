package main

import (
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"
)

const wrkOut = `Running 5s test @ http://127.0.0.1:40000/v1/completions
  2 threads and 64 connections
  Thread Stats   Avg      Stdev     Max   +/- Stdev
    Latency     5.10ms    3.20ms  40.00ms   80.00%
    Req/Sec     6.50k   500.00     7.20k    70.00%
  Latency Distribution
     50%  820.00us
     75%    5.00ms
     90%    9.00ms
     99%    1.20s
  65000 requests in 5.00s, 20.00MB read
Requests/sec:  12999.50
Transfer/sec:      4.00MB
`

func TestParseWrk(t *testing.T) {
	r, err := parseWrk(wrkOut)
	if err != nil {
		t.Fatal(err)
	}
	if r.requests != 65000 || r.rps != 12999.5 || r.p50 != 820*time.Microsecond || r.p99 != 1200*time.Millisecond {
		t.Errorf("parsed %+v", r)
	}
}

func TestParseWrkRejectsFailures(t *testing.T) {
	for _, extra := range []string{
		"  Socket errors: connect 0, read 3, write 0, timeout 0\n",
		"  Non-2xx or 3xx responses: 12\n",
	} {
		s := strings.Replace(wrkOut, "Requests/sec:", extra+"Requests/sec:", 1)
		if _, err := parseWrk(s); err == nil {
			t.Errorf("no error for %q", extra)
		}
	}
	if _, err := parseWrk("wrk: connection refused"); err == nil {
		t.Error("no error for output without a report")
	}
}

func TestStraceTotal(t *testing.T) {
	out := `% time     seconds  usecs/call     calls    errors syscall
------ ----------- ----------- --------- --------- ----------------
 60.00    0.600000          12     50000           write
 40.00    0.400000           4    100000     50000 read
------ ----------- ----------- --------- --------- ----------------
100.00    1.000000           6    150000     50000 total
`
	n, err := straceTotal(out)
	if err != nil || n != 150000 {
		t.Errorf("straceTotal = %d, %v; want 150000", n, err)
	}
}

func TestMedian(t *testing.T) {
	if m := median([]float64{3, 1, 2}); m != 2 {
		t.Errorf("median odd = %v", m)
	}
	if m := median([]float64{4, 1, 3, 2}); m != 2.5 {
		t.Errorf("median even = %v", m)
	}
}

func TestParseFlags(t *testing.T) {
	o, err := parseFlags([]string{"-conns", "8, 64", "-compare", "/tmp/x"})
	if err != nil || len(o.conns) != 2 || o.conns[1] != 64 || o.compare != "/tmp/x" {
		t.Errorf("parseFlags = %+v, %v", o, err)
	}
	if _, err := parseFlags([]string{"-conns", "0"}); err == nil {
		t.Error("-conns 0 accepted")
	}
}

// -daemon-env takes NAME=VALUE pairs only, and -daemon-log names one file
// per daemon.
func TestParseDaemonRun(t *testing.T) {
	o, err := parseFlags([]string{"-daemon-env", "GODEBUG=gctrace=1, GOGC=200", "-daemon-log", "/tmp/logs"})
	if err != nil || !slices.Equal(o.daemonEnv, []string{"GODEBUG=gctrace=1", "GOGC=200"}) {
		t.Fatalf("parseFlags = %q, %v", o.daemonEnv, err)
	}
	if r := o.runFor("compare"); r.logPath != "/tmp/logs/compare.log" || len(r.env) != 2 {
		t.Errorf("runFor = %+v", r)
	}
	if r := (options{}).runFor("loxilb"); r.logPath != "" || r.env != nil {
		t.Errorf("runFor without flags = %+v", r)
	}
	for _, bad := range []string{"GOGC", "=1", "A=1,B"} {
		if _, err := parseFlags([]string{"-daemon-env", bad}); err == nil {
			t.Errorf("-daemon-env %q accepted", bad)
		}
		if _, err := parseFlags([]string{"-compare-env", bad}); err == nil {
			t.Errorf("-compare-env %q accepted", bad)
		}
	}
	// -compare-env reaches the compare daemon only, after -daemon-env.
	o, err = parseFlags([]string{"-daemon-env", "GODEBUG=gctrace=1", "-compare-env", "GOGC=off"})
	if err != nil {
		t.Fatal(err)
	}
	if r := o.runFor("compare"); !slices.Equal(r.env, []string{"GODEBUG=gctrace=1", "GOGC=off"}) {
		t.Errorf("compare env %q", r.env)
	}
	if r := o.runFor("loxilb"); !slices.Equal(r.env, []string{"GODEBUG=gctrace=1"}) {
		t.Errorf("loxilb env %q", r.env)
	}
}

// procRunDelay reads this process's threads' run-queue wait: it only
// grows, and an unknown pid reads 0.
func TestProcRunDelay(t *testing.T) {
	if _, err := os.Stat("/proc/self/task"); err != nil {
		if os.Getenv("CI") == "true" {
			t.Fatalf("CI runs on Linux, where /proc/self/task must exist: %v", err)
		}
		t.Skip("no /proc")
	}
	a := procRunDelay(os.Getpid())
	b := procRunDelay(os.Getpid())
	if a < 0 || b < a {
		t.Fatalf("run delay went %v -> %v", a, b)
	}
	if procRunDelay(0) != 0 || procRunDelay(1<<30) != 0 {
		t.Fatal("an unknown pid has a run delay")
	}
}

// The TTFB loop starts only once the subscriber is connected and every
// staged tokenizer had its load attempt, whatever its result.
func TestSettled(t *testing.T) {
	dir := t.TempDir()
	for _, d := range []string{"a__b", "c__d"} {
		if err := os.Mkdir(filepath.Join(dir, d), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	var body atomic.Value
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		_, _ = io.WriteString(w, body.Load().(string))
	}))
	defer srv.Close()
	c := srv.Client()
	for _, tc := range []struct {
		metrics string
		ok      bool
	}{
		{"loxilb_kv_subscriber_connected{service=\"1\"} 0\nloxilb_tokenizer_loads_total{result=\"ok\"} 2\n", false},
		{"loxilb_kv_subscriber_connected{service=\"1\"} 1\nloxilb_tokenizer_loads_total{result=\"ok\"} 1\n", false},
		{"loxilb_kv_subscriber_connected{service=\"1\"} 1\nloxilb_tokenizer_loads_total{result=\"ok\"} 1\nloxilb_tokenizer_loads_total{result=\"invalid\"} 1\n", true},
		{"loxilb_kv_subscriber_connected{service=\"1\"} 1\nloxilb_tokenizer_loads_total{result=\"ok\"} 2\n", true},
	} {
		body.Store(tc.metrics)
		if err := settled(c, srv.URL, dir); (err == nil) != tc.ok {
			t.Errorf("settled(%q) = %v, want ok=%v", tc.metrics, err, tc.ok)
		}
	}
}

// A daemon's allocation counter is read from its export, and an export
// without it is an error, not a zero.
func TestAllocated(t *testing.T) {
	var body atomic.Value
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		_, _ = io.WriteString(w, body.Load().(string))
	}))
	defer srv.Close()
	v := &ttfbTarget{name: "d", metrics: srv.URL}
	body.Store("# TYPE go_memstats_alloc_bytes_total counter\ngo_memstats_alloc_bytes_total 1.2345e+08\ngo_memstats_alloc_bytes 1\n")
	if got, err := v.allocated(); err != nil || got != 1.2345e8 {
		t.Errorf("allocated = %v, %v", got, err)
	}
	body.Store("go_memstats_alloc_bytes 1\n")
	if _, err := v.allocated(); err == nil {
		t.Error("an export without the counter gave no error")
	}
}

func TestBackendStreamsEvents(t *testing.T) {
	ln, err := startBackend(3, time.Millisecond)
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	resp, err := http.Post("http://"+ln.Addr().String()+"/v1/completions", "application/json", strings.NewReader(reqBody))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	if ct := resp.Header.Get("Content-Type"); ct != "text/event-stream" || strings.Count(string(b), "data: ") != 4 ||
		!strings.HasSuffix(string(b), "data: [DONE]\n\n") {
		t.Errorf("answer %q (%s), want 3 events and [DONE]", b, ct)
	}
}

func TestStraceKinds(t *testing.T) {
	out := `% time     seconds  usecs/call     calls    errors syscall
------ ----------- ----------- --------- --------- ----------------
 60.00    0.600000          12     50000           write
 40.00    0.400000           4    100000     50000 read
------ ----------- ----------- --------- --------- ----------------
100.00    1.000000           6    150000     50000 total
`
	got := straceKinds(out)
	want := []straceKind{{"read", 100000, 50000}, {"write", 50000, 0}}
	if !reflect.DeepEqual(got, want) {
		t.Errorf("straceKinds = %+v, want %+v", got, want)
	}
}

func TestStatusField(t *testing.T) {
	b := []byte("Name:\tloxilb\nvoluntary_ctxt_switches:\t1234\nnonvoluntary_ctxt_switches:\t56\n")
	if n := statusField(b, "voluntary_ctxt_switches:"); n != 1234 {
		t.Errorf("voluntary = %d, want 1234", n)
	}
	if n := statusField(b, "nonvoluntary_ctxt_switches:"); n != 56 {
		t.Errorf("nonvoluntary = %d, want 56", n)
	}
	if n := statusField(b, "missing:"); n != 0 {
		t.Errorf("missing = %d, want 0", n)
	}
}

func TestProcSwitchesOfThisProcess(t *testing.T) {
	pid := os.Getpid()
	before := procSwitches(pid)
	time.Sleep(10 * time.Millisecond) // this thread sleeps: one voluntary switch at least
	if after := procSwitches(pid); after <= before {
		t.Errorf("voluntary switches %d then %d, want an increase", before, after)
	}
}
