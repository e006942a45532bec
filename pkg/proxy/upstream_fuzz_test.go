package proxy

import (
	"bufio"
	"errors"
	"io"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"
)

// FuzzUpstreamResponse feeds arbitrary bytes from a fake endpoint through
// the proxy's own upstream read path (request write, header parse under
// the header cap, interim responses, body with its timeouts) and checks
// that it never panics, never holds more than the cap for headers, and
// names an oversize header block as such.
func FuzzUpstreamResponse(f *testing.F) {
	for _, s := range []string{
		"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}",
		"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n5\r\ndata:\r\n0\r\n\r\n",
		"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n",
		"HTTP/1.1 200 OK\r\nX-Long: " + strings.Repeat("a", 5000),
		"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nffffffffffffffff\r\n",
		"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nshort",
		"HTTP/1.0 200 OK\r\n\r\nuntil close",
		"HTTP/1.1 101 Switching Protocols\r\n\r\n",
		"garbage\r\n\r\n",
		"HTTP/1.1 200 OK\r\nTrailer: X-T\r\nTransfer-Encoding: chunked\r\n\r\n0\r\nX-T: 1\r\n\r\n",
	} {
		f.Add([]byte(s))
	}
	const headerCap = 4 << 10
	cfg := Config{ResponseHeaderTimeout: 2 * time.Second, StreamIdleTimeout: 2 * time.Second,
		MaxResponseHeaderBytes: headerCap}.withDefaults()
	f.Fuzz(func(t *testing.T, raw []byte) {
		u := newUpstream(cfg, nil)
		u.maxIdle = 0 // never pool: every run closes its pipe
		cli, srv := net.Pipe()
		done := make(chan struct{})
		go func() {
			defer close(done)
			defer srv.Close()
			req, err := http.ReadRequest(bufio.NewReader(srv))
			if err != nil {
				return
			}
			_, _ = io.Copy(io.Discard, req.Body)
			_, _ = srv.Write(raw)
		}()
		defer func() { <-done }()
		defer cli.Close()
		pc := u.newPconn("endpoint", cli, cli)
		req, _ := http.NewRequest(http.MethodPost, "http://endpoint/v1/completions", strings.NewReader("{}"))
		resp, err := pc.exchange(req.Context(), &stdRequest{req: req}, req, false, u.lim)
		if err != nil {
			pc.close()
			if errors.Is(err, ErrUpstreamHeaderTooLarge) && len(raw) < headerCap {
				t.Fatalf("%d bytes reported as over the %d byte header cap", len(raw), headerCap)
			}
			return
		}
		if resp.StatusCode < 200 && resp.StatusCode != http.StatusSwitchingProtocols {
			t.Fatalf("interim status %d returned as the final response", resp.StatusCode)
		}
		_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 1<<20))
		_ = resp.Body.Close()
	})
}
