package main

import (
	"context"
	"encoding/binary"
	"math/rand/v2"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"

	"github.com/loxilb-llm/loxilb/pkg/kvevents"
)

func TestParseVmRSS(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want int64
		bad  bool
	}{
		{in: "Name:\tloxilb\nVmPeak:\t  900 kB\nVmRSS:\t  158720 kB\nThreads:\t9\n", want: 158720},
		{in: "VmRSS:\t1 kB", want: 1},
		{in: "Name:\tzombie\nState:\tZ\n", bad: true},
		{in: "VmRSS:\t12 MB\n", bad: true},
		{in: "VmRSS:\tx kB\n", bad: true},
	} {
		got, err := parseVmRSS([]byte(tc.in))
		if tc.bad != (err != nil) || got != tc.want {
			t.Errorf("parseVmRSS(%q) = %d, %v; want %d, error %v", tc.in, got, err, tc.want, tc.bad)
		}
	}
}

func TestMetricValue(t *testing.T) {
	export := `# HELP go_goroutines Number of goroutines that currently exist.
# TYPE go_goroutines gauge
go_goroutines 57
go_goroutines_extra 3
loxilb_kv_decode_errors_total{service="a",ep="0"} 2
loxilb_kv_decode_errors_total{service="a",ep="1"} 5.5
loxilb_kv_decode_errors_totally 100
`
	for _, tc := range []struct {
		name string
		want float64
		ok   bool
	}{
		{"go_goroutines", 57, true},
		{"loxilb_kv_decode_errors_total", 7.5, true},
		{"go_threads", 0, false},
	} {
		got, ok := metricValue([]byte(export), tc.name)
		if got != tc.want || ok != tc.ok {
			t.Errorf("metricValue(%s) = %v, %v; want %v, %v", tc.name, got, ok, tc.want, tc.ok)
		}
	}
}

func TestVerdict(t *testing.T) {
	b := Bounds{GoroutineSlack: 50, RSSGrowthMiB: 128, RSSLimitMiB: 3072}
	before := &Sample{Goroutines: 40, RSSKiB: 150 << 10}
	for _, tc := range []struct {
		name         string
		alive, guard bool
		before       *Sample
		after        *Sample
		want         []string // substrings of the failures, in order
	}{
		{"settled", true, false, before, &Sample{Goroutines: 90, RSSKiB: 278 << 10}, nil},
		{"goroutine leak", true, false, before, &Sample{Goroutines: 91, RSSKiB: 150 << 10}, []string{"goroutine leak: 91 after settle, 40 before"}},
		{"rss growth", true, false, before, &Sample{Goroutines: 40, RSSKiB: 279 << 10}, []string{"RSS growth: 279 MiB"}},
		{"both", true, false, before, &Sample{Goroutines: 500, RSSKiB: 1 << 20}, []string{"goroutine leak", "RSS growth"}},
		{"died", false, false, before, nil, []string{"daemon died"}},
		{"guard", false, true, before, nil, []string{"crossed the 3072 MiB guard and was killed"}},
		{"no samples", true, false, nil, nil, []string{"no before/after sample"}},
	} {
		got := verdict(tc.alive, tc.guard, tc.before, tc.after, 4<<20, b)
		if len(got) != len(tc.want) {
			t.Errorf("%s: verdict = %q, want %d failures", tc.name, got, len(tc.want))
			continue
		}
		for i, w := range tc.want {
			if !strings.Contains(got[i], w) {
				t.Errorf("%s: failure %d = %q, want it to contain %q", tc.name, i, got[i], w)
			}
		}
	}
}

// TestPublisherSpeaksZMTP checks the hand-written ZMTP against zmq4, the
// daemon's library: a SUB completes the handshake and receives a forged
// batch that the daemon's decoder accepts.
func TestPublisherSpeaksZMTP(t *testing.T) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	p := &badPublisher{counts: map[string]int{}}
	rng := rand.New(rand.NewPCG(1, 2))
	payload := forged(rng, false)
	go func() {
		c, err := l.Accept()
		if err != nil {
			return
		}
		defer c.Close()
		if !p.handshake(c, "PUB", rng) {
			return
		}
		// Resend until the SUB's subscription has surely arrived.
		for i := uint64(0); i < 100; i++ {
			if _, err := c.Write(zmtpMsg(nil, binary.BigEndian.AppendUint64(nil, i), payload)); err != nil {
				return
			}
			time.Sleep(20 * time.Millisecond)
		}
	}()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	sub := zmq4.NewSub(ctx)
	defer sub.Close()
	if err := sub.SetOption(zmq4.OptionSubscribe, ""); err != nil {
		t.Fatal(err)
	}
	if err := sub.Dial("tcp://" + l.Addr().String()); err != nil {
		t.Fatal(err)
	}
	msg, err := sub.Recv()
	if err != nil {
		t.Fatal(err)
	}
	if len(msg.Frames) != 3 || len(msg.Frames[1]) != 8 || string(msg.Frames[2]) != string(payload) {
		t.Fatalf("frames %d, want [topic, seq, payload]", len(msg.Frames))
	}
	var b kvevents.Batch
	if err := kvevents.NewDecoder(kvevents.KeyLast8).Decode(msg.Frames[2], &b); err != nil {
		t.Fatalf("forged batch does not decode: %v", err)
	}
}

func TestZMTPFrameLengths(t *testing.T) {
	short := zmtpFrame(flagMore, make([]byte, 255))
	if short[0] != flagMore || short[1] != 255 || len(short) != 257 {
		t.Errorf("255-byte frame header % x", short[:2])
	}
	long := zmtpFrame(0, make([]byte, 256))
	if long[0] != flagLong || binary.BigEndian.Uint64(long[1:9]) != 256 || len(long) != 265 {
		t.Errorf("256-byte frame header % x", long[:9])
	}
	p := &badPublisher{}
	for _, b := range p.garbage(rand.New(rand.NewPCG(3, 4)), 4096) {
		if b&flagLong != 0 {
			t.Fatal("garbage without the huge-frame attack has a long-frame flag")
		}
	}
}

func TestDaemonCrashLog(t *testing.T) {
	d := &daemon{}
	_, _ = d.Write([]byte("level=WARN msg=one\nlevel=WARN msg=two\n"))
	_, _ = d.Write([]byte("level=WARN msg=three\nfatal error: runtime: out of memory\n\nruntime stack:\n"))
	for range 1000 {
		_, _ = d.Write([]byte("goroutine 7 [select]:\nruntime.gopark(...)\n"))
	}
	got := d.crashLog(100)
	if !strings.HasPrefix(got, "level=WARN msg=one\nlevel=WARN msg=two\nlevel=WARN msg=three\nfatal error: runtime: out of memory\n") {
		t.Errorf("crash log starts %q", got[:min(len(got), 120)])
	}
	if len(got) > preKeep+crashKeep+8 {
		t.Errorf("crash log %d bytes, want at most %d", len(got), preKeep+crashKeep+8)
	}
	clean := &daemon{}
	_, _ = clean.Write([]byte("a line mentioning panic: inside it\nlast line\n"))
	if got := clean.crashLog(12); got != "last line\n" {
		t.Errorf("crash log without a crash = %q, want the tail", got)
	}
}
