//go:build linux

package control

import (
	"context"
	"encoding/binary"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"testing"
	"time"

	cebpf "github.com/cilium/ebpf"
	"golang.org/x/sys/unix"

	"github.com/loxilb-llm/loxilb/pkg/dataplane/dataplanetest"
	"github.com/loxilb-llm/loxilb/pkg/dataplane/ebpf"
	"github.com/loxilb-llm/loxilb/pkg/lbrule"
	"github.com/loxilb-llm/loxilb/pkg/store"
)

// benchKernelRules is how many rules of a population are L4 (installed in
// the kernel data plane, whose table holds 256 services); the rest are
// mode-4 rules, which the kernel reconciler sees but does not install.
const benchKernelRules = 200

func benchRule(i int, l4 bool) string {
	a, b := byte(i>>8), byte(i)
	if !l4 {
		return fmt.Sprintf(`{"serviceArguments":{"externalIP":"127.1.%d.%d","port":8000,"protocol":"tcp","mode":4,"sel":0},"endpoints":[{"endpointIP":"127.0.0.11","targetPort":30000,"weight":1}]}`, a, b)
	}
	return fmt.Sprintf(`{"serviceArguments":{"externalIP":"172.28.%d.%d","port":80,"protocol":"tcp","mode":0,"sel":0},"endpoints":[{"endpointIP":"172.27.%d.10","targetPort":8080,"weight":1},{"endpointIP":"172.27.%d.11","targetPort":8080,"weight":1}]}`, a, b, b, b)
}

// fillConntrack writes n established flows into the pinned conntrack map,
// spread over the first kernel services' table indices.
func fillConntrack(b *testing.B, pin string, n, services int) {
	m, err := cebpf.LoadPinnedMap(filepath.Join(pin, "lb_conntrack"), nil)
	if err != nil {
		b.Fatal(err)
	}
	defer m.Close()
	ks, vs := int(m.KeySize()), int(m.ValueSize())
	var ts unix_timespec
	now := ts.monotonic()
	for i := range n {
		k := make([]byte, ks)
		binary.BigEndian.PutUint32(k[0:], 0xac1e0000|uint32(i>>16)) // client 172.30.x.y
		binary.BigEndian.PutUint32(k[4:], 0xac1c0000|uint32(i%max(services, 1)))
		binary.BigEndian.PutUint16(k[8:], uint16(i))
		binary.BigEndian.PutUint16(k[10:], 80)
		k[12] = 6
		v := make([]byte, vs)
		svc := i % max(services, 1)
		binary.NativeEndian.PutUint64(v[0:], now)                     // last_seen_ns
		binary.BigEndian.PutUint32(v[28:], 0xac1b000a|uint32(svc)<<8) // new_daddr: the service's first endpoint
		binary.BigEndian.PutUint16(v[34:], 8080)                      // new_dport
		binary.NativeEndian.PutUint32(v[36:], 3600)                   // timeout_s
		binary.NativeEndian.PutUint16(v[40:], uint16(svc))            // svc_idx
		v[44] = 0x02                                                  // flags: rewrite destination
		v[45] = 1                                                     // state: established
		if err := m.Put(k, v); err != nil {
			b.Fatalf("fill conntrack: %v", err)
		}
	}
}

// BenchmarkRuleCreate measures the latency of creating one L4 rule through
// the controller into the real eBPF data plane (store write included), with
// 1, 100 and 1,000 rules present and 0 or 100k conntrack entries. Each case
// creates and deletes a rule several times and reports the mean and the
// worst create.
func BenchmarkRuleCreate(b *testing.B) {
	dataplanetest.RequirePrivileged(b)
	if !dataplanetest.InNetNS() {
		dataplanetest.RunBenchInNetNS(b, dataplanetest.NewNetNS(b, "lbcreate"))
		return
	}
	for _, rules := range []int{1, 100, 1000} {
		for _, ct := range []int{0, 100_000} {
			b.Run(fmt.Sprintf("rules=%d/conntrack=%d", rules, ct), func(b *testing.B) {
				benchCreate(b, rules, ct)
			})
		}
	}
}

func benchCreate(b *testing.B, rules, ct int) {
	ctx := context.Background()
	pin := filepath.Join("/sys/fs/bpf", dataplanetest.UniqueName("lbcb"))
	defer os.RemoveAll(pin)
	dp, err := ebpf.New(ebpf.Config{PinPath: pin, GCInterval: time.Hour}, nil)
	if err != nil {
		b.Fatal(err)
	}
	defer dp.Purge()
	st, err := store.OpenBolt(b.TempDir())
	if err != nil {
		b.Fatal(err)
	}
	defer st.Close()
	env := lbrule.Settings{}
	for i := range rules {
		r, err := lbrule.Decode([]byte(benchRule(i, i < benchKernelRules)))
		if err == nil {
			r, err = lbrule.Prepare(r, env)
		}
		if err != nil {
			b.Fatal(err)
		}
		enc, _ := lbrule.Encode(r)
		id, _ := st.NextID()
		if err := st.Put(store.Record{ID: id, Rule: enc, CreatedAt: time.Now(), UpdatedAt: time.Now()}); err != nil {
			b.Fatal(err)
		}
	}
	c := New(st, env, nil)
	c.AddReconciler(&KernelReconciler{DP: dp})
	if err := c.Load(ctx); err != nil {
		b.Fatal(err)
	}
	fillConntrack(b, pin, ct, min(rules, benchKernelRules))
	const reps = 5
	var lat []time.Duration
	for range b.N {
		for i := range reps {
			body := benchRule(250+i, true)
			t0 := time.Now()
			svc, _, err := c.Create(ctx, []byte(body))
			lat = append(lat, time.Since(t0))
			if err != nil {
				b.Fatal(err)
			}
			if err := c.Delete(ctx, svc.Rule.Key()); err != nil {
				b.Fatal(err)
			}
		}
	}
	var sum time.Duration
	for _, d := range lat {
		sum += d
	}
	b.ReportMetric(float64(sum.Microseconds())/float64(len(lat))/1000, "ms/create")
	b.ReportMetric(float64(slices.Max(lat).Microseconds())/1000, "ms/create-max")
}

type unix_timespec struct{}

// monotonic is CLOCK_MONOTONIC in ns, the clock of bpf_ktime_get_ns.
func (unix_timespec) monotonic() uint64 {
	var ts unix.Timespec
	unix.ClockGettime(unix.CLOCK_MONOTONIC, &ts)
	return uint64(ts.Nano())
}
