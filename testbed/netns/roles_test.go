package netns

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
)

// The test binary doubles as the lab's backend server and as a client that
// reuses one source port, started inside their namespaces via nsenter.
const roleEnv = "LOXILB_LAB_ROLE"

func TestMain(m *testing.M) {
	switch os.Getenv(roleEnv) {
	case "backend":
		serveBackend(os.Getenv("LOXILB_LAB_NAME"))
		return
	case "client":
		os.Exit(reuseClient())
	case "held":
		os.Exit(heldClient())
	}
	os.Exit(m.Run())
}

// serveBackend answers every request with its name and the connection's
// addresses, on :8080 (NAT modes) and :80 (DSR keeps the service port).
func serveBackend(name string) {
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		local := r.Context().Value(http.LocalAddrContextKey).(net.Addr)
		fmt.Fprintf(w, "name=%s remote=%s local=%s\n", name, r.RemoteAddr, local)
	})
	for _, addr := range []string{":8080", ":80"} {
		ln, err := net.Listen("tcp4", addr)
		if err != nil {
			fmt.Println("error", err)
			os.Exit(1)
		}
		go http.Serve(ln, h)
	}
	fmt.Println("ready")
	io.Copy(io.Discard, os.Stdin) // exit when the parent closes stdin
}

// reuseClient makes LOXILB_LAB_COUNT sequential HTTP/1.1 requests to
// LOXILB_LAB_TARGET, each a new connection from the same source port; the
// server closes first. Prints the backend names; exit 1 on any failure.
func reuseClient() int {
	target := os.Getenv("LOXILB_LAB_TARGET")
	count, _ := strconv.Atoi(os.Getenv("LOXILB_LAB_COUNT"))
	port, _ := strconv.Atoi(os.Getenv("LOXILB_LAB_PORT"))
	d := net.Dialer{
		Timeout:   5 * time.Second,
		LocalAddr: &net.TCPAddr{IP: net.IPv4(172, 30, 1, 2), Port: port},
		Control: func(_, _ string, c syscall.RawConn) error {
			var serr error
			c.Control(func(fd uintptr) { serr = syscall.SetsockoptInt(int(fd), syscall.SOL_SOCKET, syscall.SO_REUSEADDR, 1) })
			return serr
		},
	}
	for i := range count {
		var c net.Conn
		var err error
		for try := 0; try < 50; try++ { // the last ACK of the previous connection may be in flight
			if c, err = d.DialContext(context.Background(), "tcp4", target); err == nil || !strings.Contains(err.Error(), "address already in use") {
				break
			}
			time.Sleep(20 * time.Millisecond)
		}
		if err != nil {
			fmt.Printf("fail %d dial: %v\n", i, err)
			return 1
		}
		fmt.Fprintf(c, "GET / HTTP/1.1\r\nHost: lab\r\nConnection: close\r\n\r\n")
		c.SetDeadline(time.Now().Add(5 * time.Second))
		body, err := io.ReadAll(bufio.NewReader(c))
		c.Close()
		if err != nil || !strings.Contains(string(body), "name=") {
			fmt.Printf("fail %d read: %v %q\n", i, err, body)
			return 1
		}
		i := strings.Index(string(body), "name=")
		fmt.Println(strings.Fields(string(body)[i:])[0])
	}
	return 0
}

// heldClient opens one keep-alive connection to LOXILB_LAB_TARGET, makes a
// request, prints "connected <name>", then waits for a line on stdin and
// makes a second request on the same connection. It prints "reset <ms>" when
// the connection is reset, "timeout" when nothing comes back within 5 s,
// else "ok <name>".
func heldClient() int {
	c, err := net.DialTimeout("tcp4", os.Getenv("LOXILB_LAB_TARGET"), 5*time.Second)
	if err != nil {
		fmt.Println("fail dial:", err)
		return 1
	}
	defer c.Close()
	br := bufio.NewReader(c)
	get := func() (string, error) {
		c.SetDeadline(time.Now().Add(5 * time.Second))
		if _, err := io.WriteString(c, "GET / HTTP/1.1\r\nHost: lab\r\n\r\n"); err != nil {
			return "", err
		}
		resp, err := http.ReadResponse(br, nil)
		if err != nil {
			return "", err
		}
		defer resp.Body.Close()
		b, err := io.ReadAll(resp.Body)
		if err != nil {
			return "", err
		}
		i := strings.Index(string(b), "name=")
		if i < 0 {
			return "", fmt.Errorf("no name in %q", b)
		}
		return strings.Fields(string(b)[i:])[0], nil
	}
	name, err := get()
	if err != nil {
		fmt.Println("fail first request:", err)
		return 1
	}
	fmt.Println("connected", name)
	bufio.NewReader(os.Stdin).ReadString('\n')
	t0 := time.Now()
	name, err = get()
	var ne net.Error
	switch {
	case err == nil:
		fmt.Println("ok", name)
	case errors.Is(err, syscall.ECONNRESET):
		fmt.Println("reset", time.Since(t0).Milliseconds())
	case errors.As(err, &ne) && ne.Timeout():
		fmt.Println("timeout")
	default:
		fmt.Println("fail second request:", err)
	}
	return 0
}
