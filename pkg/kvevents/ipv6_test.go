package kvevents

import (
	"context"
	"net"
	"os"
	"slices"
	"strconv"
	"testing"

	"github.com/go-zeromq/zmq4"
)

func TestIPv6Endpoint(t *testing.T) {
	sock := zmq4.NewPub(context.Background())
	t.Cleanup(func() { sock.Close() })
	if err := sock.Listen("tcp://[::1]:0"); err != nil {
		if os.Getenv("CI") == "true" {
			t.Fatalf("CI machines have an IPv6 loopback; this test must run: %v", err)
		}
		t.Skipf("no IPv6 loopback here: %v", err)
	}
	p := &publisher{t: t, sock: sock, port: sock.Addr().(*net.TCPAddr).Port}
	spec := vllmSpec(p.port)
	spec.Host = "::1"
	h := startManager(t, fastConfig(), spec)
	if ep := h.status(7, 2).Ranks[0].Endpoint; ep != "tcp://[::1]:"+itoa(p.port) {
		t.Fatalf("endpoint = %s", ep)
	}
	p.handshake(h, 7, 2, 0, 1, storedBatch(5))
	if got := h.sink.keys(7, 2, 0); !slices.Equal(got, []uint64{5}) {
		t.Fatalf("inventory = %v", got)
	}
}

func itoa(n int) string { return strconv.Itoa(n) }
