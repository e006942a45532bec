package hostile

import (
	"bufio"
	"bytes"
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/loxilb-llm/loxilb/testbed/daemontest"
)

// controlRule is a mode-4 rule on a loopback VIP; its endpoint is never
// contacted by the control-plane attacks.
func controlRule(vip string, port int, extra string) string {
	return fmt.Sprintf(`{"serviceArguments":{"externalIP":%q,"port":%d,"protocol":"tcp","mode":4%s},
"endpoints":[{"endpointIP":"127.0.0.1","targetPort":9,"weight":1}]}`, vip, port, extra)
}

// controlRunDaemon runs the daemon binary to completion (it must refuse to
// start) and returns its exit code and output.
func controlRunDaemon(t *testing.T, args ...string) (int, string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, bins.Loxilb, args...)
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	err := cmd.Run()
	if ctx.Err() != nil {
		t.Fatalf("daemon did not exit within 30s:\n%s", out.String())
	}
	var ee *exec.ExitError
	switch {
	case err == nil:
		return 0, out.String()
	case errors.As(err, &ee):
		return ee.ExitCode(), out.String()
	}
	t.Fatal(err)
	return 0, ""
}

// controlErrorBody is the API's error shape.
type controlErrorBody struct {
	Code       int    `json:"code"`
	Message    string `json:"message"`
	Field      string `json:"field"`
	ReasonCode string `json:"reason_code"`
}

func controlExpect(t *testing.T, d *daemontest.Daemon, method, path, body string, code int, field, reason string) {
	t.Helper()
	got, b := apiDo(t, d, method, path, body)
	var e controlErrorBody
	_ = json.Unmarshal(b, &e)
	if got != code || (field != "" && e.Field != field) || (reason != "" && e.ReasonCode != reason) {
		t.Fatalf("%s %s: %d %s, want %d field %q reason %q", method, path, got, b, code, field, reason)
	}
}

// TestControlCorruptStore: whatever damage rules.db has, the daemon exits
// non-zero naming the file and the way out, never panics, never starts
// empty over it, and leaves the file as it was.
func TestControlCorruptStore(t *testing.T) {
	dir := t.TempDir()
	d := daemontest.Start(t, bins, dir, nil, "--tokenizer-dir", tokenizerDir())
	for i := 0; i < 20; i++ {
		createRule(t, d, controlRule(fmt.Sprintf("127.0.77.%d", i+1), 28080, fmt.Sprintf(`,"name":"r%d"`, i)))
	}
	d.Stop()
	pristine, err := os.ReadFile(filepath.Join(dir, "rules.db"))
	if err != nil {
		t.Fatal(err)
	}
	ps := int(binary.NativeEndian.Uint32(pristine[16+8:]))
	hwm := int(max(binary.NativeEndian.Uint64(pristine[16+40:]), binary.NativeEndian.Uint64(pristine[ps+16+40:])))
	zero := func(b []byte, off, n int) []byte {
		for i := off; i < off+n && i < len(b); i++ {
			b[i] = 0
		}
		return b
	}
	variants := map[string]func(b []byte) []byte{
		"empty file":          func(b []byte) []byte { return nil },
		"truncated to 100 B":  func(b []byte) []byte { return b[:100] },
		"truncated to 1 page": func(b []byte) []byte { return b[:ps] },
		"last page cut":       func(b []byte) []byte { return b[:(hwm-1)*ps] },
		"meta 0 zeroed":       func(b []byte) []byte { return zero(b, 0, ps) },
		"meta 1 zeroed":       func(b []byte) []byte { return zero(b, ps, ps) },
		"wrong magic":         func(b []byte) []byte { copy(b[16:], "BAD!"); copy(b[ps+16:], "BAD!"); return b },
		"random meta bytes": func(b []byte) []byte {
			r := rand.New(rand.NewPCG(1, 1))
			for i := 16; i < 80; i++ {
				b[i], b[ps+i] = byte(r.Uint32()), byte(r.Uint32())
			}
			return b
		},
		"data pages zeroed": func(b []byte) []byte { return zero(b, 2*ps, len(b)) },
		"data page headers flipped": func(b []byte) []byte {
			for p := 2; p < hwm; p++ {
				b[p*ps+8] ^= 0x07 // page flags
			}
			return b
		},
		"garbage": func(b []byte) []byte { return []byte("not a rule store at all\n") },
	}
	for name, edit := range variants {
		t.Run(name, func(t *testing.T) {
			sd := t.TempDir()
			path := filepath.Join(sd, "rules.db")
			b := edit(append([]byte(nil), pristine...))
			if err := os.WriteFile(path, b, 0o600); err != nil {
				t.Fatal(err)
			}
			code, out := controlRunDaemon(t, "--api-addr", fmt.Sprintf("127.0.0.1:%d", daemontest.FreePort(t)), "--state-dir", sd,
				"--no-dataplane", "--tokenizer-dir", tokenizerDir())
			if code == 0 || strings.Contains(out, "panic") || strings.Contains(out, "goroutine ") {
				t.Fatalf("exit %d:\n%s", code, out)
			}
			if !strings.Contains(out, "rule store "+path+" is corrupt") || !strings.Contains(out, "move it aside") {
				t.Fatalf("message does not name the file and the way out:\n%s", out)
			}
			if strings.Contains(out, "loxilb started") {
				t.Fatalf("daemon started over a corrupt store:\n%s", out)
			}
			if after, _ := os.ReadFile(path); !bytes.Equal(after, b) {
				t.Fatal("the corrupt file was modified")
			}
		})
	}
}

// controlSlowPost sends a create request's headers and one byte of a
// declared 1000-byte body, then stalls.
func controlSlowPost(addr, auth string) (net.Conn, error) {
	c, err := net.DialTimeout("tcp", addr, 5*time.Second)
	if err != nil {
		return nil, err
	}
	h := "POST /netlox/v1/config/loadbalancer HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n"
	if auth != "" {
		h += "Authorization: " + auth + "\r\n"
	}
	if _, err := io.WriteString(c, h+"\r\n{"); err != nil {
		c.Close()
		return nil, err
	}
	return c, nil
}

func controlOpenFDs(t *testing.T, pid int) int {
	t.Helper()
	ents, err := os.ReadDir(fmt.Sprintf("/proc/%d/fd", pid))
	if err != nil {
		t.Fatal(err)
	}
	return len(ents)
}

// TestControlSlowBodies: 220 connections that never finish their body do
// not starve the API: other clients are served at once, every slow
// connection is cut with a 408 at --api-read-timeout, counted, and the
// daemon's descriptors and memory go back down.
func TestControlSlowBodies(t *testing.T) {
	const n = 220
	// The read timeout is wide so the second client's turn fits inside it
	// on a loaded machine too: what is checked is that it is served while
	// the slow ones are held, not how fast.
	const readTimeout = 6 * time.Second
	d := startDaemon(t, nil, "--api-read-timeout", readTimeout.String())
	addr := fmt.Sprintf("127.0.0.1:%d", d.Port)
	fd0 := controlOpenFDs(t, d.PID())
	conns := make([]net.Conn, 0, n)
	defer func() {
		for _, c := range conns {
			c.Close()
		}
	}()
	start := time.Now()
	for i := 0; i < n; i++ {
		c, err := controlSlowPost(addr, "")
		if err != nil {
			t.Fatalf("slow conn %d: %v", i, err)
		}
		conns = append(conns, c)
	}
	// A second client is served while every slow one is held.
	t0 := time.Now()
	createRule(t, d, controlRule("127.0.78.1", 28080, ""))
	if code, _ := apiDo(t, d, http.MethodGet, "/config/loadbalancer/all", ""); code != http.StatusOK {
		t.Fatalf("list: %d", code)
	}
	// Served before the read timeout cuts the slow ones: they do not
	// hold it up.
	if el := time.Since(t0); el >= readTimeout {
		t.Fatalf("second client took %v under the attack, not served before the slow bodies were cut", el)
	}
	requireAlive(t, d)
	// Every slow connection is answered 408 and closed near the timeout.
	var wg sync.WaitGroup
	var mu sync.Mutex
	var bad []string
	for i, c := range conns {
		wg.Add(1)
		go func() {
			defer wg.Done()
			_ = c.SetReadDeadline(start.Add(readTimeout + 10*time.Second))
			br := bufio.NewReader(c)
			resp, err := http.ReadResponse(br, nil)
			if err == nil {
				_, _ = io.ReadAll(resp.Body)
				resp.Body.Close()
				if resp.StatusCode != http.StatusRequestTimeout {
					err = fmt.Errorf("status %d", resp.StatusCode)
				} else if _, rerr := br.ReadByte(); rerr != io.EOF {
					err = fmt.Errorf("not closed after the 408: %v", rerr)
				}
			}
			if err != nil {
				mu.Lock()
				bad = append(bad, fmt.Sprintf("conn %d: %v", i, err))
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	if len(bad) > 0 {
		t.Fatalf("%d slow connections not cut in time, e.g. %s", len(bad), bad[0])
	}
	t.Logf("all %d slow connections cut %v after the first", n, time.Since(start).Round(time.Millisecond))
	requireAlive(t, d)
	requireRSSBelow(t, d, 200)
	if v := metricSum(t, d, "loxilb_api_rejected_total", `reason="body_timeout"`); v < n {
		t.Fatalf("body_timeout counted %v, want >= %d", v, n)
	}
	waitFor(t, 5*time.Second, "descriptors back to the idle count", func() bool { return controlOpenFDs(t, d.PID()) <= fd0+10 })
}

// TestControlSlowHeaders: 220 clients that never finish their headers are
// cut at --api-read-header-timeout and counted; others are served meanwhile.
func TestControlSlowHeaders(t *testing.T) {
	const n = 220
	d := startDaemon(t, nil, "--api-read-header-timeout", "1s")
	addr := fmt.Sprintf("127.0.0.1:%d", d.Port)
	conns := make([]net.Conn, 0, n)
	defer func() {
		for _, c := range conns {
			c.Close()
		}
	}()
	start := time.Now()
	for i := 0; i < n; i++ {
		c, err := net.DialTimeout("tcp", addr, 5*time.Second)
		if err != nil {
			t.Fatalf("conn %d: %v", i, err)
		}
		if _, err := io.WriteString(c, "GET /netlox/v1/version HTTP/1.1\r\nHost: x\r\nX-Slow: "); err != nil {
			t.Fatal(err)
		}
		conns = append(conns, c)
	}
	t0 := time.Now()
	if code, _ := apiDo(t, d, http.MethodGet, "/config/loadbalancer/all", ""); code != http.StatusOK {
		t.Fatalf("list: %d", code)
	}
	// Served before the read timeout cuts the slow ones: they do not
	// hold it up.
	if el := time.Since(t0); el >= 2*time.Second {
		t.Fatalf("second client took %v under the attack, not served before the slow bodies were cut", el)
	}
	for i, c := range conns {
		_ = c.SetReadDeadline(start.Add(6 * time.Second))
		if _, err := io.ReadAll(c); err != nil {
			t.Fatalf("conn %d not cut: %v", i, err)
		}
	}
	t.Logf("all %d slow-header connections cut %v after the first", n, time.Since(start).Round(time.Millisecond))
	waitFor(t, 3*time.Second, "no_request counted", func() bool {
		return metricSum(t, d, "loxilb_api_rejected_total", `reason="no_request"`) >= n
	})
	requireAlive(t, d)
	requireRSSBelow(t, d, 200)
}

// TestControlConnCap: beyond --api-max-conns, connections are closed at
// accept and counted; the daemon serves again once the holders go.
func TestControlConnCap(t *testing.T) {
	const capN, n = 16, 200
	d := startDaemon(t, nil, "--api-max-conns", fmt.Sprint(capN), "--api-read-header-timeout", "30s")
	addr := fmt.Sprintf("127.0.0.1:%d", d.Port)
	held := make([]net.Conn, 0, n)
	defer func() {
		for _, c := range held {
			c.Close()
		}
	}()
	for i := 0; i < n; i++ {
		c, err := net.DialTimeout("tcp", addr, 5*time.Second)
		if err != nil {
			t.Fatalf("dial %d: %v", i, err)
		}
		held = append(held, c)
	}
	closed := 0
	for _, c := range held {
		_ = c.SetReadDeadline(time.Now().Add(200 * time.Millisecond))
		if _, err := c.Read(make([]byte, 1)); err == io.EOF || errors.Is(err, syscall.ECONNRESET) {
			closed++
		}
	}
	if closed < n-capN {
		t.Fatalf("%d of %d connections closed over a cap of %d", closed, n, capN)
	}
	for _, c := range held {
		c.Close()
	}
	waitFor(t, 5*time.Second, "API served again", func() bool {
		resp, err := http.Get(d.URL("/version"))
		if err == nil {
			resp.Body.Close()
		}
		return err == nil
	})
	if v := metricSum(t, d, "loxilb_api_rejected_total", `reason="conn_limit"`); v < n-capN {
		t.Fatalf("conn_limit counted %v, want >= %d", v, n-capN)
	}
	requireAlive(t, d)
	requireRSSBelow(t, d, 200)
}

// TestControlUnauthenticatedBody: with a token configured, a request
// without a valid one is answered 401/403 at once and its connection
// closed; its body is never waited for.
func TestControlUnauthenticatedBody(t *testing.T) {
	tok := filepath.Join(t.TempDir(), "token")
	if err := os.WriteFile(tok, []byte("s3cret\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	d := startDaemon(t, nil, "--api-token-file", tok, "--api-read-timeout", "30s")
	addr := fmt.Sprintf("127.0.0.1:%d", d.Port)
	for i := 0; i < 100; i++ {
		auth := ""
		want := http.StatusUnauthorized
		if i%2 == 1 {
			auth, want = "Bearer wrong", http.StatusForbidden
		}
		c, err := controlSlowPost(addr, auth)
		if err != nil {
			t.Fatal(err)
		}
		t0 := time.Now()
		_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
		br := bufio.NewReader(c)
		resp, err := http.ReadResponse(br, nil)
		if err != nil {
			t.Fatalf("attempt %d: no answer: %v", i, err)
		}
		_, _ = io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != want || !resp.Close {
			t.Fatalf("attempt %d: %d close=%v, want %d with Connection: close", i, resp.StatusCode, resp.Close, want)
		}
		if _, err := br.ReadByte(); err != io.EOF {
			t.Fatalf("attempt %d: connection kept open for the body: %v", i, err)
		}
		if el := time.Since(t0); el > 2*time.Second {
			t.Fatalf("attempt %d: answered after %v", i, el)
		}
		c.Close()
	}
	requireRSSBelow(t, d, 200)
	// The export needs the token too.
	req, _ := http.NewRequest(http.MethodGet, d.URL("/metrics"), nil)
	req.Header.Set("Authorization", "Bearer s3cret")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	// The daemon's readiness probe (no token) is one more 401.
	for reason, want := range map[string]float64{"unauthorized": 50, "forbidden": 50} {
		if v := controlSample(b, "loxilb_api_rejected_total", `reason="`+reason+`"`); v < want || v > want+5 {
			t.Fatalf("%s counted %v, want %v:\n%s", reason, v, want, grepLines(b, "loxilb_api_"))
		}
	}
}

// TestControlMappedVIP: an IPv4-mapped VIP is the IPv4 VIP: stored in
// IPv4 form, deletable by either spelling, and a conflict (not a 500) with
// the same rule written in IPv4.
func TestControlMappedVIP(t *testing.T) {
	d := startDaemon(t, nil)
	port := daemontest.FreePort(t)
	createRule(t, d, controlRule("::ffff:127.0.79.1", port, ""))
	_, b := apiDo(t, d, http.MethodGet, "/config/loadbalancer/all", "")
	if !strings.Contains(string(b), `"externalIP":"127.0.79.1"`) || strings.Contains(string(b), "::ffff:") {
		t.Fatalf("VIP not stored in IPv4 form: %s", b)
	}
	controlExpect(t, d, http.MethodPost, "/config/loadbalancer", controlRule("127.0.79.1", port, `,"sel":1`), http.StatusOK, "", "")
	controlExpect(t, d, http.MethodDelete, fmt.Sprintf("/config/loadbalancer/externalipaddress/127.0.79.1/port/%d/protocol/tcp", port), "", http.StatusOK, "", "")
	createRule(t, d, controlRule("127.0.79.2", port, ""))
	controlExpect(t, d, http.MethodDelete, fmt.Sprintf("/config/loadbalancer/externalipaddress/::ffff:127.0.79.2/port/%d/protocol/tcp", port), "", http.StatusOK, "", "")
	_, b = apiDo(t, d, http.MethodGet, "/config/loadbalancer/all", "")
	if strings.Contains(string(b), "127.0.79.") {
		t.Fatalf("rules left: %s", b)
	}
	if v := metricSum(t, d, "loxilb_api_errors_total", `status="500"`); v != 0 {
		t.Fatalf("%v answers were 500", v)
	}
	requireAlive(t, d)
}

// TestControlStrictKeys: duplicate and case-variant keys are 400s naming
// the key, counted; loxilb's own spellings keep working.
func TestControlStrictKeys(t *testing.T) {
	d := startDaemon(t, nil)
	port := daemontest.FreePort(t)
	good := controlRule("127.0.80.1", port, `,"kvExactMode":0,"pd_disagg_mode":false`)
	for _, c := range []struct{ from, to, field string }{
		{`"port":`, `"port":1,"port":`, "serviceArguments.port"},
		{`"externalIP":`, `"externalIP":"127.0.80.9","externalIP":`, "serviceArguments.externalIP"},
		{`"externalIP"`, `"externalip"`, "serviceArguments.externalip"},
		{`"kvExactMode"`, `"KVEXACTMODE"`, "serviceArguments.KVEXACTMODE"},
		{`"pd_disagg_mode"`, `"PD_Disagg_Mode"`, "serviceArguments.PD_Disagg_Mode"},
		{`"endpointIP"`, `"EndpointIP"`, "endpoints[0].EndpointIP"},
		{`"targetPort":`, `"targetPort":1,"targetPort":`, "endpoints[0].targetPort"},
	} {
		controlExpect(t, d, http.MethodPost, "/config/loadbalancer", strings.Replace(good, c.from, c.to, 1), http.StatusBadRequest, c.field, "")
	}
	createRule(t, d, good)
	if v := metricSum(t, d, "loxilb_api_errors_total", `status="400"`); v < 7 {
		t.Fatalf("400s counted %v, want >= 7", v)
	}
	requireAlive(t, d)
}

// TestControlConfigErrorsTyped: configuration mistakes are 400/409/412
// with a reason, never 500: bad probes and names, TLS without the proxy
// certificate, a VIP:port another process holds.
func TestControlConfigErrorsTyped(t *testing.T) {
	d := startDaemon(t, nil)
	port := daemontest.FreePort(t)
	lb := "/config/loadbalancer"
	controlExpect(t, d, http.MethodPost, lb, controlRule("127.0.81.1", port, `,"probetype":"http","probereq":"GET /health HTTP/1.1"`), http.StatusBadRequest, "serviceArguments.probereq", "")
	controlExpect(t, d, http.MethodPost, lb, controlRule("127.0.81.1", port, `,"probetype":"http","probereq":"/h\r\nX: y"`), http.StatusBadRequest, "serviceArguments.probereq", "")
	controlExpect(t, d, http.MethodPost, lb, controlRule("127.0.81.1", port, `,"probetype":"tcp","probeTimeout":9999999999`), http.StatusBadRequest, "serviceArguments.probeTimeout", "")
	controlExpect(t, d, http.MethodPost, lb, controlRule("127.0.81.1", port, `,"probetype":"snmp"`), http.StatusBadRequest, "serviceArguments.probetype", "")
	controlExpect(t, d, http.MethodPost, lb, controlRule("127.0.81.1", port, `,"sel":8,"chwbl_prefix_hash_level":9`), http.StatusBadRequest, "serviceArguments.chwbl_prefix_hash_level", "")
	controlExpect(t, d, http.MethodPost, lb, controlRule("127.0.81.1", port, `,"security":1,"mtls_frontend":{"client_cert_mode":"required","client_ca_path":"/etc/ca.pem","client_crl_path":"/etc/ca.crl"}`),
		http.StatusPreconditionFailed, "serviceArguments.mtls_frontend.client_crl_path", "MTLS_FRONTEND_UNSUPPORTED")
	controlExpect(t, d, http.MethodPost, lb, controlRule("127.0.81.1", port, `,"name":"a/b"`), http.StatusBadRequest, "serviceArguments.name", "")
	controlExpect(t, d, http.MethodPost, lb, controlRule("127.0.81.1", port, `,"name":"`+strings.Repeat("n", 200)+`"`), http.StatusBadRequest, "serviceArguments.name", "")
	controlExpect(t, d, http.MethodPost, lb, controlRule("127.0.81.1", port, `,"security":1`), http.StatusPreconditionFailed, "serviceArguments.security", "PROXY_TLS_CERT_UNSET")
	controlExpect(t, d, http.MethodPost, lb, controlRule("127.0.81.1", port, `,"security":2`), http.StatusPreconditionFailed, "serviceArguments.security", "PROXY_TLS_CERT_UNSET")
	// Another process holds the VIP:port.
	held, err := net.Listen("tcp", fmt.Sprintf("127.0.81.2:%d", port))
	if err != nil {
		t.Fatal(err)
	}
	defer held.Close()
	controlExpect(t, d, http.MethodPost, lb, controlRule("127.0.81.2", port, ""), http.StatusConflict, "", "VIP_PORT_IN_USE")
	// The table rolled back: the same rule works once the port is free.
	held.Close()
	createRule(t, d, controlRule("127.0.81.2", port, ""))
	// A second mode-4 rule on the VIP:port, told apart by block mark only.
	controlExpect(t, d, http.MethodPost, lb, controlRule("127.0.81.2", port, `,"block":7`), http.StatusConflict, "serviceArguments.block", "")
	if v := metricSum(t, d, "loxilb_api_errors_total", `status="500"`); v != 0 {
		t.Fatalf("%v answers were 500", v)
	}
	if v := metricSum(t, d, "loxilb_api_errors_total", `status="412"`, `reason="PROXY_TLS_CERT_UNSET"`); v != 2 {
		t.Fatalf("412 PROXY_TLS_CERT_UNSET counted %v, want 2", v)
	}
	if v := metricSum(t, d, "loxilb_api_errors_total", `status="409"`, `reason="VIP_PORT_IN_USE"`); v != 1 {
		t.Fatalf("409 VIP_PORT_IN_USE counted %v, want 1", v)
	}
	requireAlive(t, d)
}

// TestControlCleartextTokenRefused: a token on a non-loopback API address
// without TLS stops the daemon before it binds or opens anything. The
// port is held on 127.0.0.1 meanwhile, so an attempt to bind 0.0.0.0 on it
// would fail differently; nothing is contacted.
func TestControlCleartextTokenRefused(t *testing.T) {
	held, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer held.Close()
	port := held.Addr().(*net.TCPAddr).Port
	tok := filepath.Join(t.TempDir(), "token")
	if err := os.WriteFile(tok, []byte("s3cret"), 0o600); err != nil {
		t.Fatal(err)
	}
	sd := t.TempDir()
	code, out := controlRunDaemon(t, "--api-addr", fmt.Sprintf("0.0.0.0:%d", port), "--api-token-file", tok,
		"--state-dir", sd, "--no-dataplane", "--tokenizer-dir", tokenizerDir())
	if code == 0 || !strings.Contains(out, "cleartext") || !strings.Contains(out, "--api-allow-cleartext") {
		t.Fatalf("exit %d:\n%s", code, out)
	}
	if strings.Contains(out, "address already in use") || strings.Contains(out, "loxilb started") {
		t.Fatalf("the daemon got as far as binding:\n%s", out)
	}
	if _, err := os.Stat(filepath.Join(sd, "rules.db")); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("the rule store was opened before the refusal: %v", err)
	}
	// A bad limit stops it too, naming the flag.
	code, out = controlRunDaemon(t, "--api-read-timeout", "0s", "--state-dir", sd, "--no-dataplane")
	if code == 0 || !strings.Contains(out, "--api-read-timeout") {
		t.Fatalf("bad --api-read-timeout: exit %d:\n%s", code, out)
	}
}

func grepLines(b []byte, prefix string) string {
	var out []string
	for _, l := range strings.Split(string(b), "\n") {
		if strings.HasPrefix(l, prefix) {
			out = append(out, l)
		}
	}
	return strings.Join(out, "\n")
}

// controlSample reads one sample from a Prometheus text export.
func controlSample(b []byte, name, label string) float64 {
	for _, l := range strings.Split(string(b), "\n") {
		if strings.HasPrefix(l, name+"{") && strings.Contains(l, label) {
			var v float64
			if _, err := fmt.Sscan(l[strings.LastIndexByte(l, ' ')+1:], &v); err == nil {
				return v
			}
		}
	}
	return 0
}
