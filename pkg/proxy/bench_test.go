package proxy

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"runtime/pprof"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// The benchmarks measure small non-streaming requests through the proxy
// against a direct connection and against Debian's haproxy as a reverse
// proxy, all in one run on loopback. Load is generated in-process by a
// fixed pool of keep-alive clients sending a bounded number of requests.

const (
	benchConcurrency = 16
	benchReqBody     = `{"model":"m","prompt":"hello","max_tokens":1}`
)

var benchRespBody = []byte(`{"id":"cmpl-1","object":"text_completion","choices":[{"index":0,"text":"hi","finish_reason":"length"}],"usage":{"prompt_tokens":1,"completion_tokens":1,"total_tokens":2,"prompt_tokens_details":{"cached_tokens":0}}}`)

func benchBackend(b *testing.B) *httptest.Server {
	b.Helper()
	s := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		w.Header().Set("Content-Type", "application/json")
		_, _ = w.Write(benchRespBody)
	}))
	b.Cleanup(s.Close)
	return s
}

// benchProxy starts the proxy with a one-endpoint picker on vip.
func benchProxy(b *testing.B, vip, backend string) string {
	b.Helper()
	ln, err := net.Listen("tcp", net.JoinHostPort(vip, "0"))
	if err != nil {
		b.Fatal(err)
	}
	cands := []Endpoint{{Idx: 0, Addr: backend}}
	picker := PickerFunc(func(context.Context, *Request) (Plan, error) {
		return Plan{Candidates: cands, Receipt: "bench"}, nil
	})
	cfg := Config{Services: []Service{{ID: 1, Listen: ln.Addr().(*net.TCPAddr).AddrPort()}}}
	s, err := New(cfg, picker, new(InFlightTable), slog.New(slog.DiscardHandler), nil)
	if err != nil {
		b.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { _ = s.ServeListener(ctx, ln); close(done) }()
	b.Cleanup(func() { cancel(); <-done })
	return ln.Addr().String()
}

// Environment of the proxy child process used by BenchmarkSideBySide.
const (
	envChildListen  = "LOXILB_PROXY_BENCH_CHILD_LISTEN"
	envChildBackend = "LOXILB_PROXY_BENCH_CHILD_BACKEND"
	// envChildProfile, if set in the benchmark's environment, makes the
	// proxy process write a CPU profile there.
	envChildProfile = "LOXILB_PROXY_BENCH_CPUPROFILE"
	// envChildRuntime holds extra environment for the proxy process only.
	envChildRuntime = "LOXILB_PROXY_BENCH_CHILD_ENV"
)

// TestMain turns the test binary into a bare proxy process when asked, so
// the side-by-side benchmark can run the proxy in its own process exactly
// like haproxy: the load generator and the backend then share one Go
// runtime, and each proxy gets its own scheduler share from the kernel.
func TestMain(m *testing.M) {
	if listen := os.Getenv(envChildListen); listen != "" {
		os.Exit(runBenchChild(listen, os.Getenv(envChildBackend)))
	}
	os.Exit(m.Run())
}

// runBenchChild serves until its stdin closes (the parent exited or is
// done), then exits.
func runBenchChild(listen, backend string) int {
	ln, err := net.Listen("tcp", listen)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	cands := []Endpoint{{Idx: 0, Addr: backend}}
	picker := PickerFunc(func(context.Context, *Request) (Plan, error) {
		return Plan{Candidates: cands, Receipt: "bench"}, nil
	})
	cfg := Config{Services: []Service{{ID: 1, Listen: ln.Addr().(*net.TCPAddr).AddrPort()}}}
	s, err := New(cfg, picker, new(InFlightTable), slog.New(slog.DiscardHandler), nil)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	ctx, cancel := context.WithCancel(context.Background())
	go func() {
		_, _ = io.Copy(io.Discard, os.Stdin)
		cancel()
	}()
	if path := os.Getenv(envChildProfile); path != "" {
		f, err := os.Create(path)
		if err == nil && pprof.StartCPUProfile(f) == nil {
			defer func() { pprof.StopCPUProfile(); f.Close() }()
		}
	}
	fmt.Println("ready")
	err = s.ServeListener(ctx, ln)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	return 0
}

// startProxyProcess runs the proxy in a child process (see TestMain).
func startProxyProcess(b *testing.B, vip, backend string) (string, int) {
	b.Helper()
	addr := freeAddrB(b, vip)
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), envChildListen+"="+addr, envChildBackend+"="+backend)
	// Runtime settings for the proxy process only, e.g. "GOGC=400 GOMAXPROCS=1",
	// to measure what the daemon's runtime tuning buys.
	cmd.Env = append(cmd.Env, strings.Fields(os.Getenv(envChildRuntime))...)
	stdin, err := cmd.StdinPipe()
	if err != nil {
		b.Fatal(err)
	}
	out, err := cmd.StdoutPipe()
	if err != nil {
		b.Fatal(err)
	}
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	if err := cmd.Start(); err != nil {
		b.Fatalf("start proxy process: %v", err)
	}
	b.Cleanup(func() {
		stdin.Close()
		_ = cmd.Wait()
	})
	line := make([]byte, 6)
	if _, err := io.ReadFull(out, line); err != nil || string(line) != "ready\n" {
		b.Fatalf("proxy process did not start (%q, %v): %s", line, err, stderr.String())
	}
	go func() { _, _ = io.Copy(io.Discard, out) }()
	return addr, cmd.Process.Pid
}

// startHAProxy runs haproxy in the foreground as an HTTP reverse proxy to
// backend, configured like the proxy (keep-alive both sides, connection
// reuse, X-Forwarded-For). It skips the benchmark when haproxy is absent.
func startHAProxy(b *testing.B, vip, backend string) (string, int) {
	b.Helper()
	bin, err := exec.LookPath("haproxy")
	if err != nil {
		b.Skip("haproxy not installed (apt-get install haproxy); skipping the haproxy comparison")
	}
	addr := freeAddrB(b, vip)
	conf := fmt.Sprintf(`global
	maxconn 4096
	nbthread 2
defaults
	mode http
	timeout connect 5s
	timeout client 60s
	timeout server 60s
	option http-keep-alive
	option forwardfor
	http-reuse always
frontend fe
	bind %s
	default_backend be
backend be
	server s0 %s
`, addr, backend)
	path := filepath.Join(b.TempDir(), "haproxy.cfg")
	if err := os.WriteFile(path, []byte(conf), 0o600); err != nil {
		b.Fatal(err)
	}
	cmd := exec.Command(bin, "-db", "-f", path)
	var stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = io.Discard, &stderr
	if err := cmd.Start(); err != nil {
		b.Fatalf("start haproxy: %v", err)
	}
	exited := make(chan struct{})
	go func() { _ = cmd.Wait(); close(exited) }()
	b.Cleanup(func() {
		_ = cmd.Process.Kill()
		<-exited
	})
	for i := 0; ; i++ {
		c, err := net.Dial("tcp", addr)
		if err == nil {
			c.Close()
			return addr, cmd.Process.Pid
		}
		select {
		case <-exited:
			b.Fatalf("haproxy exited: %s", stderr.String())
		default:
		}
		if i > 2000 {
			b.Fatalf("haproxy did not listen on %s: %s", addr, stderr.String())
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func freeAddrB(b *testing.B, ip string) string {
	ln, err := net.Listen("tcp", net.JoinHostPort(ip, "0"))
	if err != nil {
		b.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().String()
}

// loadStats is the outcome of one bounded load run.
type loadStats struct {
	n       int
	elapsed time.Duration
	lat     []time.Duration
}

func (s loadStats) rps() float64 { return float64(s.n) / s.elapsed.Seconds() }

func (s loadStats) pct(p float64) time.Duration {
	if len(s.lat) == 0 {
		return 0
	}
	l := slices.Clone(s.lat)
	slices.Sort(l)
	return l[int(float64(len(l)-1)*p)]
}

// loadClient is a pool of keep-alive connections to one target.
type loadClient struct {
	c   *http.Client
	url string
}

func newLoadClient(addr string) *loadClient {
	return &loadClient{
		c: &http.Client{Transport: &http.Transport{
			MaxIdleConnsPerHost: benchConcurrency,
			MaxConnsPerHost:     benchConcurrency,
			DisableCompression:  true,
		}},
		url: "http://" + addr + "/v1/completions",
	}
}

// run sends n requests from benchConcurrency workers and records each
// request's latency.
func (lc *loadClient) run(b *testing.B, n int) loadStats {
	var (
		next   atomic.Int64
		wg     sync.WaitGroup
		mu     sync.Mutex
		lat    = make([]time.Duration, 0, n)
		failed atomic.Int64
	)
	start := time.Now()
	for range benchConcurrency {
		wg.Add(1)
		go func() {
			defer wg.Done()
			local := make([]time.Duration, 0, n/benchConcurrency+1)
			for next.Add(1) <= int64(n) {
				t0 := time.Now()
				resp, err := lc.c.Post(lc.url, "application/json", bytes.NewReader([]byte(benchReqBody)))
				if err != nil {
					failed.Add(1)
					continue
				}
				_, _ = io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
				if resp.StatusCode != 200 {
					failed.Add(1)
				}
				local = append(local, time.Since(t0))
			}
			mu.Lock()
			lat = append(lat, local...)
			mu.Unlock()
		}()
	}
	wg.Wait()
	st := loadStats{n: n, elapsed: time.Since(start), lat: lat}
	if f := failed.Load(); f > 0 {
		b.Fatalf("%d of %d requests failed", f, n)
	}
	return st
}

func reportLoad(b *testing.B, st loadStats) {
	b.ReportMetric(st.rps(), "req/s")
	b.ReportMetric(float64(st.pct(0.5).Microseconds()), "p50-µs")
	b.ReportMetric(float64(st.pct(0.99).Microseconds()), "p99-µs")
}

// BenchmarkThroughput measures each path on its own: b.N requests with
// benchConcurrency keep-alive clients. The proxy and haproxy run as
// separate processes; proxy-inprocess runs the proxy in the benchmark
// process (set LOXILB_PROXY_BENCH_CPUPROFILE to profile the separate one).
func BenchmarkThroughput(b *testing.B) {
	backend := hostPort(benchBackend(b))
	targets := []struct {
		name  string
		start func(b *testing.B) string
	}{
		{"direct", func(*testing.B) string { return backend }},
		{"proxy", func(b *testing.B) string { a, _ := startProxyProcess(b, "127.0.0.94", backend); return a }},
		// In this process, sharing the scheduler with the load generator
		// and the backend: pessimistic, but profilable with -cpuprofile.
		{"proxy-inprocess", func(b *testing.B) string { return benchProxy(b, "127.0.0.90", backend) }},
		{"haproxy", func(b *testing.B) string { a, _ := startHAProxy(b, "127.0.0.91", backend); return a }},
	}
	for _, tg := range targets {
		b.Run(tg.name, func(b *testing.B) {
			lc := newLoadClient(tg.start(b))
			lc.run(b, 2*benchConcurrency) // warm the pools
			b.ResetTimer()
			st := lc.run(b, b.N)
			b.StopTimer()
			reportLoad(b, st)
		})
	}
}

// BenchmarkSideBySide runs direct, proxy and haproxy in interleaved
// rounds of the same size within one benchmark, so the machine's noise
// hits all three alike. The proxy and haproxy each run as their own
// process (2 threads each), the load generator and backend in this one.
// It reports the proxy/haproxy throughput ratio
// (goal ≥ 0.8) and the latency the proxy adds over a direct connection.
// Run it with -benchtime=Nx: N is the number of rounds.
func BenchmarkSideBySide(b *testing.B) {
	const perRound = 4000
	backend := hostPort(benchBackend(b))
	proxyAddr, proxyPID := startProxyProcess(b, "127.0.0.92", backend)
	hapAddr, hapPID := startHAProxy(b, "127.0.0.93", backend)
	clients := []*loadClient{newLoadClient(backend), newLoadClient(proxyAddr), newLoadClient(hapAddr)}
	pids := []int{0, proxyPID, hapPID}
	for _, lc := range clients {
		lc.run(b, 2*benchConcurrency)
	}
	agg := make([]loadStats, len(clients))
	cpu := make([]time.Duration, len(clients))
	b.ResetTimer()
	for round := range b.N {
		for k := range clients {
			i := (k + round) % len(clients) // rotate who goes first
			c0 := procCPU(pids[i])
			st := clients[i].run(b, perRound)
			cpu[i] += procCPU(pids[i]) - c0
			agg[i].n += st.n
			agg[i].elapsed += st.elapsed
			agg[i].lat = append(agg[i].lat, st.lat...)
		}
	}
	b.StopTimer()
	names := []string{"direct", "proxy", "haproxy"}
	for i, st := range agg {
		b.ReportMetric(st.rps(), names[i]+"-req/s")
		b.ReportMetric(float64(st.pct(0.5).Microseconds()), names[i]+"-p50-µs")
		b.ReportMetric(float64(st.pct(0.99).Microseconds()), names[i]+"-p99-µs")
		if pids[i] != 0 && cpu[i] > 0 {
			b.ReportMetric(float64(cpu[i].Microseconds())/float64(st.n), names[i]+"-cpu-µs/req")
		}
	}
	b.ReportMetric(agg[1].rps()/agg[2].rps(), "proxy/haproxy")
	b.ReportMetric(float64((agg[1].pct(0.5) - agg[0].pct(0.5)).Microseconds()), "added-p50-µs")
}

// procCPU returns the user+system CPU time a process has used so far,
// from /proc (clock ticks of 10 ms; rounds are long enough for that).
func procCPU(pid int) time.Duration {
	if pid == 0 {
		return 0
	}
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0
	}
	// Fields after the parenthesised command name; utime and stime are
	// the 14th and 15th fields of the whole line.
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

// BenchmarkModelOf measures the request parser on a chat body of about
// 64 KiB with the model key last (worst case for the top-level scan).
func BenchmarkModelOf(b *testing.B) {
	var buf bytes.Buffer
	buf.WriteString(`{"messages":[`)
	for i := range 200 {
		if i > 0 {
			buf.WriteByte(',')
		}
		fmt.Fprintf(&buf, `{"role":"user","content":"message %d with some text to tokenize, quotes \" and escapes \\n, {braces} and [brackets] inside strings..................................................................................................................................................................."}`, i)
	}
	buf.WriteString(`],"stream":true,"model":"Qwen/Qwen2.5-7B-Instruct"}`)
	body := buf.Bytes()
	h := http.Header{}
	b.SetBytes(int64(len(body)))
	b.ReportAllocs()
	for b.Loop() {
		if ModelOf(h, body) != "Qwen/Qwen2.5-7B-Instruct" {
			b.Fatal("wrong model")
		}
	}
}
