//go:build linux

package netns

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/loxilb-llm/loxilb/pkg/dataplane"
	"github.com/loxilb-llm/loxilb/pkg/dataplane/ebpf"
)

// getOn sends one keep-alive GET over conn and returns the body.
func getOn(t *testing.T, conn net.Conn, br *bufio.Reader) string {
	t.Helper()
	conn.SetDeadline(time.Now().Add(3 * time.Second))
	if _, err := io.WriteString(conn, "GET / HTTP/1.1\r\nHost: backend\r\n\r\n"); err != nil {
		t.Fatalf("local connection: write: %v", err)
	}
	resp, err := http.ReadResponse(br, nil)
	if err != nil {
		t.Fatalf("local connection: read: %v", err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatalf("local connection: body: %v", err)
	}
	return string(b)
}

// TestOneArmSparesLocalSockets: a one-arm flow from a client whose source
// port equals that of a connection the LB itself holds to the same endpoint
// is SNATed to a port outside the host's ephemeral range, so both work: the
// LB's own connection is neither hijacked nor reset.
func TestOneArmSparesLocalSockets(t *testing.T) {
	lab := withLab(t, 1)
	if lab == nil {
		return
	}
	ctx := context.Background()
	d, err := ebpf.New(ebpf.Config{Interfaces: lab.LBIfaces, GCInterval: time.Hour}, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	vip := VIP(30)
	be := BackendAddr(0)
	if err := d.UpsertService(ctx, dataplane.Service{ID: 30, VIP: vip, Port: 80, Proto: "tcp", Mode: dataplane.ModeOneArm},
		[]dataplane.Endpoint{{Addr: be, Port: 8080, Weight: 1, Healthy: true}}); err != nil {
		t.Fatal(err)
	}
	const port = 40000 // in the host's ephemeral range, as a local socket's port would be
	dialer := net.Dialer{LocalAddr: &net.TCPAddr{IP: LBBackendIP(0).AsSlice(), Port: port}}
	conn, err := dialer.Dial("tcp4", fmt.Sprintf("%s:8080", be))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	br := bufio.NewReader(conn)
	if body := getOn(t, conn, br); !strings.Contains(body, "name=be1") {
		t.Fatalf("local connection: %q", body)
	}
	{
		out, err := Exec(lab.Client, "curl", "-sS", "--max-time", "3", "--local-port", fmt.Sprint(port),
			fmt.Sprintf("http://%s:80/", vip))
		if err != nil || !strings.Contains(out, "name=be1") {
			t.Fatalf("client through the one-arm VIP from port %d: %q %v", port, out, err)
		}
		r, err := parseReply(out)
		if err != nil {
			t.Fatal(err)
		}
		h, p, _ := net.SplitHostPort(r.remote)
		if h != LBBackendIP(0).String() || p < "61000" || len(p) != 5 {
			t.Fatalf("the endpoint saw the flow from %s, want the LB's address with a port in 61000-65535", r.remote)
		}
	}
	for range 3 {
		if body := getOn(t, conn, br); !strings.Contains(body, fmt.Sprintf("remote=%s:%d", LBBackendIP(0), port)) {
			t.Fatalf("local connection after a one-arm flow from the same port: %q", body)
		}
	}
}

// TestRemovedEndpointResets: a client holding a connection to an endpoint
// that is removed from its service gets a TCP RST on its next packet and
// fails at once, instead of retransmitting into a drop until it times out.
func TestRemovedEndpointResets(t *testing.T) {
	lab := withLab(t, 2)
	if lab == nil {
		return
	}
	ctx := context.Background()
	d, err := ebpf.New(ebpf.Config{Interfaces: lab.LBIfaces, GCInterval: time.Hour}, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	vip := VIP(31)
	svc := dataplane.Service{ID: 31, VIP: vip, Port: 80, Proto: "tcp", Mode: dataplane.ModeDNAT}
	if err := d.UpsertService(ctx, svc, labEndpoints(lab, 8080)); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command("nsenter", "--net=/run/netns/"+lab.Client, os.Args[0])
	cmd.Env = append(os.Environ(), roleEnv+"=held", "LOXILB_LAB_TARGET="+vip.String()+":80")
	stdin, _ := cmd.StdinPipe()
	stdout, _ := cmd.StdoutPipe()
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer cmd.Wait()
	defer cmd.Process.Kill()
	out := bufio.NewReader(stdout)
	line, _ := out.ReadString('\n')
	name, ok := strings.CutPrefix(strings.TrimSpace(line), "connected name=")
	if !ok {
		t.Fatalf("client: %q", line)
	}
	// Keep only the endpoint the client is not on.
	var keep []dataplane.Endpoint
	for i, ep := range labEndpoints(lab, 8080) {
		if fmt.Sprintf("be%d", i+1) != name {
			keep = append(keep, ep)
		}
	}
	if err := d.UpsertService(ctx, svc, keep); err != nil {
		t.Fatal(err)
	}
	io.WriteString(stdin, "go\n")
	line, _ = out.ReadString('\n')
	if !strings.HasPrefix(line, "reset ") {
		t.Fatalf("client on the removed endpoint %s: %q, want its connection reset", name, line)
	}
	st, err := d.Stats(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if st.Counters["rst_sent"] < 1 || st.Counters["flow_stale"] < 1 {
		t.Fatalf("counters: rst_sent %d, flow_stale %d", st.Counters["rst_sent"], st.Counters["flow_stale"])
	}
	t.Logf("client reset after %s ms", strings.TrimSpace(strings.TrimPrefix(line, "reset ")))
}
