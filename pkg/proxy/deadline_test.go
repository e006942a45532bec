package proxy

import (
	"bufio"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"sync/atomic"
	"testing"
	"time"

	"github.com/loxilb-llm/loxilb/testbed/wait"
)

// TestCoarseDeadline: a deadline is moved only when it would cut a wait
// short or fire more than a sixteenth late, and then set a sixteenth late.
func TestCoarseDeadline(t *testing.T) {
	now := time.Unix(1000, 0)
	d := 16 * time.Second
	cases := []struct {
		name   string
		cur    time.Time
		want   time.Time
		change bool
	}{
		{"none", time.Time{}, now.Add(17 * time.Second), true},
		{"in range, at its start", now.Add(d), now.Add(d), false},
		{"in range, at its end", now.Add(17 * time.Second), now.Add(17 * time.Second), false},
		{"too early: would cut the wait", now.Add(d - time.Nanosecond), now.Add(17 * time.Second), true},
		{"too late: another bound's", now.Add(17*time.Second + time.Nanosecond), now.Add(17 * time.Second), true},
		{"expired", now.Add(-time.Second), now.Add(17 * time.Second), true},
	}
	for _, c := range cases {
		got, change := coarseDeadline(c.cur, now, d)
		if !got.Equal(c.want) || change != c.change {
			t.Errorf("%s: got %v %v, want %v %v", c.name, got.Sub(now), change, c.want.Sub(now), c.change)
		}
	}
}

// TestClientResetSeenPastIdleDeadline: the idle deadline set before a
// request's head stays during the request (readHead), and the watch timer
// of an earlier request on the connection is still scheduled (arm). A
// request that outlasts both must still be watched: the client's reset
// cancels the endpoint's work.
func TestClientResetSeenPastIdleDeadline(t *testing.T) {
	var n atomic.Int64
	entered := make(chan struct{})
	sawCancel := make(chan struct{})
	b := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.ReadAll(r.Body)
		if n.Add(1) == 1 {
			_, _ = io.WriteString(w, `{"quick":true}`)
			return
		}
		close(entered)
		<-r.Context().Done()
		close(sawCancel)
	}))
	defer b.Close()
	p := newStaticPicker(hostPort(b))
	// The idle deadline (20 ms, at most 1.25 ms late) expires long before
	// the watch reads the connection (watchDelay).
	px := startProxy(t, "127.0.0.160", Config{IdleTimeout: 20 * time.Millisecond}, Service{}, p)
	c, err := net.Dial("tcp", px.addr)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	br := bufio.NewReader(c)
	req := "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}"
	fmt.Fprint(c, req)
	resp, err := http.ReadResponse(br, nil)
	if err != nil {
		t.Fatal(err)
	}
	if body, err := io.ReadAll(resp.Body); err != nil || string(body) != `{"quick":true}` {
		t.Fatalf("first answer %q, %v", body, err)
	}
	if r := p.waitResult(t); r.Status != http.StatusOK {
		t.Fatalf("first result %+v", r)
	}
	fmt.Fprint(c, req)
	<-entered
	// Past the idle deadline and the watch delay: a watch cut short by
	// the deadline would have ended by now, blind to the reset.
	wait.Eventually(t, "the watch's delay and the idle deadline to pass", func() bool {
		return n.Load() == 2 && px.dr.active.Load() == 1 && watchStarted(t, px)
	})
	_ = c.(*net.TCPConn).SetLinger(0)
	c.Close() // RST
	wait.Eventually(t, "the endpoint's request cancelled", func() bool {
		select {
		case <-sawCancel:
			return true
		default:
			return false
		}
	})
	if r := p.waitResult(t); r.Status != StatusClientClosed {
		t.Errorf("result %+v, want 499", r)
	}
}

// watchStarted reports whether the one connection of px has its client
// watch reading.
func watchStarted(t *testing.T, px *proxyUnderTest) bool {
	t.Helper()
	h := &px.h1
	h.mu.Lock()
	defer h.mu.Unlock()
	for c := range h.conns {
		c.wmu.Lock()
		running := c.wstate == wRunning
		c.wmu.Unlock()
		return running
	}
	return false
}
