package outlier

import (
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
)

type clock struct{ t time.Time }

func (c *clock) now() time.Time          { return c.t }
func (c *clock) advance(d time.Duration) { c.t = c.t.Add(d) }
func newTest(t *testing.T, cfg Config) (*Detector, *clock, *prometheus.Registry) {
	t.Helper()
	reg := prometheus.NewRegistry()
	d, err := New(cfg, nil, reg)
	if err != nil {
		t.Fatal(err)
	}
	c := &clock{t: time.Unix(1000, 0)}
	d.now = c.now
	return d, c, reg
}

func observeN(d *Detector, p Pool, ep int, addr string, o Outcome, n int) (ejected bool) {
	for range n {
		if d.Observe(p, ep, addr, o) {
			ejected = true
		}
	}
	return ejected
}

func TestThresholds(t *testing.T) {
	d, _, _ := newTest(t, Config{})
	p := Pool{Service: 1, Size: 4}
	if observeN(d, p, 0, "a", GatewayFailure, 2) || d.Ejected(1, RoleNone, "a") {
		t.Fatal("ejected after 2 gateway failures")
	}
	if !d.Observe(p, 0, "a", GatewayFailure) || !d.Ejected(1, RoleNone, "a") {
		t.Fatal("not ejected after 3 gateway failures")
	}
	if observeN(d, p, 1, "b", ServerError, 4) {
		t.Fatal("ejected after 4 5xx")
	}
	d.Observe(p, 1, "b", Success) // resets
	if observeN(d, p, 1, "b", ServerError, 4) {
		t.Fatal("success did not reset the count")
	}
	if !d.Observe(p, 1, "b", ServerError) {
		t.Fatal("not ejected after 5 consecutive 5xx")
	}
	// A 5xx answer proves the connection works: gateway count restarts.
	observeN(d, p, 2, "c", GatewayFailure, 2)
	d.Observe(p, 2, "c", ServerError)
	if d.Observe(p, 2, "c", GatewayFailure) {
		t.Fatal("gateway failures not consecutive but ejected")
	}
}

func TestBackoffProbationAndDecay(t *testing.T) {
	d, c, _ := newTest(t, Config{})
	p := Pool{Service: 1, Size: 2}
	want := []time.Duration{30 * time.Second, 60 * time.Second, 120 * time.Second, 240 * time.Second, 300 * time.Second, 300 * time.Second}
	observeN(d, p, 0, "a", GatewayFailure, 3)
	for i, w := range want {
		// A request routed before the ejection that succeeds late does
		// not lift the coming probation.
		d.Observe(p, 0, "a", Success)
		c.advance(w - time.Millisecond)
		if !d.Ejected(1, RoleNone, "a") {
			t.Fatalf("ejection %d ended before %v", i+1, w)
		}
		c.advance(time.Millisecond)
		if d.Ejected(1, RoleNone, "a") {
			t.Fatalf("ejection %d lasted past %v", i+1, w)
		}
		// Probation: one failure re-ejects.
		if !d.Observe(p, 0, "a", ServerError) {
			t.Fatalf("probation failure %d did not re-eject", i+1)
		}
	}
	// Serve well for MaxEjection after the last ejection: a new series.
	c.advance(300 * time.Second)
	d.Observe(p, 0, "a", Success)
	c.advance(300 * time.Second)
	d.Observe(p, 0, "a", Success)
	observeN(d, p, 0, "a", GatewayFailure, 3)
	c.advance(30 * time.Second)
	if d.Ejected(1, RoleNone, "a") {
		t.Fatal("series did not restart at the base ejection")
	}
	// Success on probation ends it: the next failure alone does not eject.
	d.Observe(p, 0, "a", Success)
	if d.Observe(p, 0, "a", GatewayFailure) {
		t.Fatal("ejected after probation ended with a success")
	}
}

func TestCap(t *testing.T) {
	d, _, reg := newTest(t, Config{})
	p := Pool{Service: 7, Size: 4}
	observeN(d, p, 0, "a", GatewayFailure, 3)
	observeN(d, p, 1, "b", GatewayFailure, 3)
	if observeN(d, p, 2, "c", GatewayFailure, 3) {
		t.Fatal("third of four ejected past the 50% cap")
	}
	if got := testutil.ToFloat64(d.capped.WithLabelValues("7", "none")); got != 1 {
		t.Fatalf("capped = %v, want 1", got)
	}
	// The last endpoint is never ejected, whatever the percent.
	d2, _, _ := newTest(t, Config{MaxEjectedPercent: 100})
	one := Pool{Service: 1, Size: 1}
	if observeN(d2, one, 0, "a", GatewayFailure, 10) {
		t.Fatal("the only endpoint was ejected")
	}
	two := Pool{Service: 2, Size: 2}
	observeN(d2, two, 0, "a", GatewayFailure, 3)
	if observeN(d2, two, 1, "b", GatewayFailure, 3) {
		t.Fatal("the last endpoint of two was ejected")
	}
	// Pools are separate: a decode ejection does not use prefill room.
	pre, dec := Pool{Service: 3, Role: RolePrefill, Size: 2}, Pool{Service: 3, Role: RoleDecode, Size: 2}
	observeN(d, pre, 0, "a", GatewayFailure, 3)
	if !observeN(d, dec, 1, "b", GatewayFailure, 3) {
		t.Fatal("decode pool shares the prefill pool's cap")
	}
	err := testutil.GatherAndCompare(reg, strings.NewReader(`
# HELP loxilb_outlier_ejected 1 while an endpoint is ejected by passive health checking.
# TYPE loxilb_outlier_ejected gauge
loxilb_outlier_ejected{ep_idx="0",role="none",service="7"} 1
loxilb_outlier_ejected{ep_idx="0",role="prefill",service="3"} 1
loxilb_outlier_ejected{ep_idx="1",role="decode",service="3"} 1
loxilb_outlier_ejected{ep_idx="1",role="none",service="7"} 1
`), "loxilb_outlier_ejected")
	if err != nil {
		t.Fatal(err)
	}
	d.Forget(3)
	if d.Ejected(3, RolePrefill, "a") {
		t.Fatal("Forget kept the record")
	}
	if n := testutil.CollectAndCount(d.ejections); n != 2 {
		t.Fatalf("%d ejection series after forgetting service 3, want service 7's 2", n)
	}
}

func TestPDOriginThreshold(t *testing.T) {
	d, _, _ := newTest(t, Config{PDOriginErrors: 2})
	pre := Pool{Service: 1, Role: RolePrefill, Size: 2}
	d.Observe(pre, 0, "a", ServerError)
	if !d.Observe(pre, 0, "a", GatewayFailure) {
		t.Fatal("breaker did not open after 2 origin errors")
	}
	plain := Pool{Service: 2, Size: 2}
	if observeN(d, plain, 0, "a", ServerError, 2) {
		t.Fatal("P/D threshold applied to a plain pool")
	}
}

func TestDisabledAndIgnore(t *testing.T) {
	d, _, _ := newTest(t, Config{Disabled: true})
	if observeN(d, Pool{Service: 1, Size: 4}, 0, "a", GatewayFailure, 10) || d.Ejected(1, RoleNone, "a") {
		t.Fatal("disabled detector ejected")
	}
	d2, _, _ := newTest(t, Config{})
	if observeN(d2, Pool{Service: 1, Size: 4}, 0, "a", Ignore, 10) {
		t.Fatal("Ignore counted")
	}
	var nilD *Detector
	if nilD.Ejected(1, RoleNone, "a") || nilD.Observe(Pool{}, 0, "a", GatewayFailure) {
		t.Fatal("nil detector ejected")
	}
}

func TestValidate(t *testing.T) {
	for _, c := range []Config{{GatewayFailures: -1}, {ServerErrors: 5000}, {BaseEjection: time.Millisecond},
		{BaseEjection: time.Minute, MaxEjection: time.Second}, {MaxEjectedPercent: 101}, {PDOriginErrors: -2}} {
		if _, err := New(c, nil, nil); err == nil {
			t.Errorf("%+v accepted", c)
		}
	}
}
