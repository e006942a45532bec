package main

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"time"
)

// respBody is the backend's answer: a short non-streaming completion.
var respBody = []byte(`{"id":"cmpl-1","object":"text_completion","choices":[{"index":0,"text":"hi","finish_reason":"length"}],"usage":{"prompt_tokens":1,"completion_tokens":1,"total_tokens":2}}`)

// sseEvent is one event of a streamed answer: a token delta as vLLM
// sends it.
var sseEvent = []byte(`data: {"id":"cmpl-1","object":"text_completion","choices":[{"index":0,"text":"hi","finish_reason":null}]}` + "\n\n")

// startBackend serves respBody to every request on a loopback port, in
// this process: it is the same for every contender. With sse > 0 it
// answers with an event stream of sse events instead, each flushed on its
// own (a chunk on the wire) after a pause of gap, then "data: [DONE]".
func startBackend(sse int, gap time.Duration) (net.Listener, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		if sse == 0 {
			w.Header().Set("Content-Type", "application/json")
			_, _ = w.Write(respBody)
			return
		}
		w.Header().Set("Content-Type", "text/event-stream")
		f := w.(http.Flusher)
		for range sse {
			if gap > 0 {
				time.Sleep(gap)
			}
			_, _ = w.Write(sseEvent)
			f.Flush()
		}
		_, _ = io.WriteString(w, "data: [DONE]\n\n")
	})}
	go func() { _ = srv.Serve(ln) }()
	return ln, nil
}

func freeAddr() (string, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return "", err
	}
	defer ln.Close()
	return ln.Addr().String(), nil
}

// output keeps the tail of a child process's output for error messages.
type output struct {
	mu sync.Mutex
	b  []byte
}

func (o *output) Write(p []byte) (int, error) {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.b = append(o.b, p...)
	if len(o.b) > 16<<10 {
		o.b = append(o.b[:0], o.b[len(o.b)-8<<10:]...)
	}
	return len(p), nil
}

func (o *output) String() string {
	o.mu.Lock()
	defer o.mu.Unlock()
	return string(o.b)
}

// proc is a child process: the daemon or haproxy.
type proc struct {
	cmd  *exec.Cmd
	out  output
	done chan struct{}
}

func startProc(name string, args ...string) (*proc, error) {
	return startProcEnv(nil, "", name, args...)
}

// startProcEnv is startProc with env added to this process's environment
// and, if logPath is set, the whole output also written to that file.
func startProcEnv(env []string, logPath, name string, args ...string) (*proc, error) {
	p := &proc{cmd: exec.Command(name, args...), done: make(chan struct{})}
	if env != nil {
		p.cmd.Env = append(os.Environ(), env...)
	}
	var w io.Writer = &p.out
	var log *os.File
	if logPath != "" {
		f, err := os.Create(logPath)
		if err != nil {
			return nil, err
		}
		log, w = f, io.MultiWriter(&p.out, f)
	}
	p.cmd.Stdout, p.cmd.Stderr = w, w
	if err := p.cmd.Start(); err != nil {
		if log != nil {
			log.Close()
		}
		return nil, fmt.Errorf("start %s: %w", name, err)
	}
	go func() {
		_ = p.cmd.Wait()
		if log != nil {
			log.Close()
		}
		close(p.done)
	}()
	return p, nil
}

// stop interrupts the process and kills it after 10 s.
func (p *proc) stop() {
	_ = p.cmd.Process.Signal(os.Interrupt)
	select {
	case <-p.done:
	case <-time.After(10 * time.Second):
		_ = p.cmd.Process.Kill()
		<-p.done
	}
}

// waitUp polls check until it succeeds, the process exits or 30 s pass.
func (p *proc) waitUp(ctx context.Context, what string, check func() error) error {
	deadline := time.Now().Add(30 * time.Second)
	for {
		err := check()
		if err == nil {
			return nil
		}
		select {
		case <-p.done:
			return fmt.Errorf("%s exited (%s):\n%s", what, p.cmd.ProcessState, p.out.String())
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(50 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("%s not up in 30 s: %v\n%s", what, err, p.out.String())
		}
	}
}

// daemon is the loxilb process with one mode-4 round-robin rule in
// front of the backend.
type daemon struct {
	*proc
	vip     string
	metrics string // the API's metrics URL
}

func startDaemon(ctx context.Context, bin, stateDir, backend string, run daemonRun) (*daemon, error) {
	c := &http.Client{Timeout: 5 * time.Second}
	return startDaemonWith(ctx, bin, daemonSpec{stateDir: stateDir, daemonRun: run,
		rule: func(vh, vp string) string {
			bh, bp, _ := net.SplitHostPort(backend)
			return fmt.Sprintf(`{"serviceArguments":{"externalIP":%q,"port":%s,"protocol":"tcp","mode":4,"sel":0},`+
				`"endpoints":[{"endpointIP":%q,"targetPort":%s,"weight":1}]}`, vh, vp, bh, bp)
		},
		ready: func(vip, _ string) error { return post(c, "http://"+vip+"/v1/completions") },
	})
}

// daemonSpec is how startDaemonWith runs the daemon: extra environment
// and flags, the rule it creates (given the VIP's host and port), and
// the check that says the VIP is ready (given the VIP and the API base).
type daemonSpec struct {
	daemonRun
	stateDir string
	args     []string
	rule     func(vipHost, vipPort string) string
	ready    func(vip, apiBase string) error
}

// daemonRun is what the command line adds to a daemon's run: environment
// (-daemon-env) and the file its output goes to (-daemon-log).
type daemonRun struct {
	env     []string
	logPath string
}

// runFor is the daemonRun of the daemon called name.
func (o options) runFor(name string) daemonRun {
	r := daemonRun{env: o.daemonEnv}
	if name == "compare" {
		r.env = append(slices.Clone(o.daemonEnv), o.compareEnv...)
	}
	if o.daemonLog != "" {
		r.logPath = filepath.Join(o.daemonLog, name+".log")
	}
	return r
}

// startDaemonWith runs the daemon proxy-only on free loopback ports,
// creates the rule and waits until ready succeeds.
func startDaemonWith(ctx context.Context, bin string, spec daemonSpec) (*daemon, error) {
	api, err := freeAddr()
	if err != nil {
		return nil, err
	}
	vip, err := freeAddr()
	if err != nil {
		return nil, err
	}
	args := append([]string{"--api-addr", api, "--state-dir", spec.stateDir, "--no-dataplane", "--log-level", "warn"}, spec.args...)
	p, err := startProcEnv(spec.env, spec.logPath, bin, args...)
	if err != nil {
		return nil, err
	}
	d := &daemon{proc: p, vip: vip, metrics: "http://" + api + "/netlox/v1/metrics"}
	c := &http.Client{Timeout: 5 * time.Second}
	base := "http://" + api + "/netlox/v1"
	if err := p.waitUp(ctx, bin, func() error { return get(c, base+"/version") }); err != nil {
		d.stop()
		return nil, err
	}
	vh, vp, _ := net.SplitHostPort(vip)
	// The rule is created while the daemon's start-up tokenizer loads take
	// its CPU: on a loaded machine the answer took more than the other
	// calls' 5 s.
	create := &http.Client{Timeout: time.Minute}
	resp, err := create.Post(base+"/config/loadbalancer", "application/json", strings.NewReader(spec.rule(vh, vp)))
	if err != nil {
		d.stop()
		return nil, fmt.Errorf("create rule: %w", err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		d.stop()
		return nil, fmt.Errorf("create rule: %d %s", resp.StatusCode, b)
	}
	if err := p.waitUp(ctx, bin+" VIP", func() error { return spec.ready(vip, base) }); err != nil {
		d.stop()
		return nil, err
	}
	return d, nil
}

// haproxy runs Debian's haproxy as the same reverse proxy: HTTP mode,
// keep-alive on both sides, pooled server connections, X-Forwarded-For,
// two threads (the machine's core count, as the daemon's GOMAXPROCS).
type haproxy struct {
	*proc
	addr string
}

func startHAProxy(ctx context.Context, dir, backend string) (*haproxy, error) {
	addr, err := freeAddr()
	if err != nil {
		return nil, err
	}
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
	path := filepath.Join(dir, "haproxy.cfg")
	if err := os.WriteFile(path, []byte(conf), 0o600); err != nil {
		return nil, err
	}
	p, err := startProc("haproxy", "-db", "-f", path)
	if err != nil {
		return nil, err
	}
	h := &haproxy{proc: p, addr: addr}
	c := &http.Client{Timeout: 5 * time.Second}
	if err := p.waitUp(ctx, "haproxy", func() error { return post(c, "http://"+addr+"/v1/completions") }); err != nil {
		h.stop()
		return nil, err
	}
	return h, nil
}

func get(c *http.Client, url string) error {
	resp, err := c.Get(url)
	if err != nil {
		return err
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("GET %s: %d", url, resp.StatusCode)
	}
	return nil
}

func post(c *http.Client, url string) error {
	resp, err := c.Post(url, "application/json", bytes.NewReader([]byte(reqBody)))
	if err != nil {
		return err
	}
	_, _ = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("POST %s: %d", url, resp.StatusCode)
	}
	return nil
}
