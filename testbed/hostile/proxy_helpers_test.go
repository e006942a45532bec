package hostile

import (
	"bufio"
	"fmt"
	"io"
	"net"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/loxilb-llm/loxilb/testbed/daemontest"
)

// proxyBackend is a hostile (or merely plain) endpoint on ip: for every
// request it reads, it runs serve on the raw connection. serve returns
// true to keep the connection for another request. The listener and
// every connection close when the test ends.
func proxyBackend(t *testing.T, ip string, serve func(c net.Conn, req *http.Request) bool) int {
	t.Helper()
	ln, err := net.Listen("tcp", ip+":0")
	if err != nil {
		t.Fatalf("listen on %s: %v", ip, err)
	}
	var mu sync.Mutex
	conns := map[net.Conn]bool{}
	var wg sync.WaitGroup
	t.Cleanup(func() {
		ln.Close()
		mu.Lock()
		for c := range conns {
			c.Close()
		}
		mu.Unlock()
		wg.Wait()
	})
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			conns[c] = true
			mu.Unlock()
			wg.Add(1)
			go func() {
				defer wg.Done()
				defer func() {
					c.Close()
					mu.Lock()
					delete(conns, c)
					mu.Unlock()
				}()
				br := bufio.NewReader(c)
				for {
					req, err := http.ReadRequest(br)
					if err != nil {
						return
					}
					_, _ = io.Copy(io.Discard, req.Body)
					if !serve(c, req) {
						return
					}
				}
			}()
		}
	}()
	return ln.Addr().(*net.TCPAddr).Port
}

// proxyDaemon starts the daemon for a proxy attack: no staged tokenizers
// (the rules route round robin, and loading tokenizers in the background
// would move the memory baseline during the attack). It returns the
// daemon and its settled resident memory in KiB.
func proxyDaemon(t *testing.T, args ...string) (*daemontest.Daemon, int64) {
	t.Helper()
	d := startDaemon(t, nil, append([]string{"--tokenizer-dir", t.TempDir()}, args...)...)
	prev := rssKiB(t, d.PID())
	for i := 0; i < 50; i++ {
		time.Sleep(100 * time.Millisecond)
		cur := rssKiB(t, d.PID())
		if cur-prev < 256 && prev-cur < 256 {
			return d, cur
		}
		prev = cur
	}
	return d, prev
}

// proxyOK answers a small JSON 200 and keeps the connection.
func proxyOK(c net.Conn, _ *http.Request) bool {
	const body = `{"ok":true}`
	_, err := fmt.Fprintf(c, "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s", len(body), body)
	return err == nil
}

// proxyRule creates a mode-4 (fullproxy) rule without KV routing: plain
// round robin to one endpoint, no health probe, so the hostile endpoint is
// always the one tried.
func proxyRule(t *testing.T, d *daemontest.Daemon, vip string, port int, epIP string, epPort int) {
	t.Helper()
	createRule(t, d, fmt.Sprintf(`{"serviceArguments":{"externalIP":%q,"port":%d,"protocol":"tcp","mode":4,"sel":0,"probetype":"none"},
		"endpoints":[{"endpointIP":%q,"targetPort":%d,"weight":1}]}`, vip, port, epIP, epPort))
}

// proxyPost sends one small request to the VIP with a fresh connection
// and returns the status, the body read so far and the body read error.
func proxyPost(t *testing.T, addr string, timeout time.Duration) (int, []byte, error) {
	t.Helper()
	c := &http.Client{Timeout: timeout, Transport: &http.Transport{DisableKeepAlives: true}}
	resp, err := c.Post("http://"+addr+"/v1/completions", "application/json", strings.NewReader(`{"model":"m","prompt":"hi"}`))
	if err != nil {
		return 0, nil, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return resp.StatusCode, b, err
}

// proxyDial opens a raw client connection to addr.
func proxyDial(t *testing.T, addr string) net.Conn {
	t.Helper()
	c, err := net.DialTimeout("tcp", addr, 5*time.Second)
	if err != nil {
		t.Fatalf("dial %s: %v", addr, err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

// proxyAddr joins a VIP and port.
func proxyAddr(vip string, port int) string { return net.JoinHostPort(vip, strconv.Itoa(port)) }
