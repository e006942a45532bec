package control

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"strings"
	"testing"

	"github.com/loxilb-llm/loxilb/pkg/dataplane"
	"github.com/loxilb-llm/loxilb/pkg/dataplane/fake"
	"github.com/loxilb-llm/loxilb/pkg/lbrule"
	"github.com/loxilb-llm/loxilb/pkg/store"
)

func l4Body(vip string, port int, proto string, mode, sel int, eps ...string) string {
	var e []string
	for _, ip := range eps {
		e = append(e, fmt.Sprintf(`{"endpointIP":%q,"targetPort":%d,"weight":1}`, ip, port))
	}
	return fmt.Sprintf(`{"serviceArguments":{"externalIP":%q,"port":%d,"protocol":%q,"mode":%d,"sel":%d},"endpoints":[%s]}`,
		vip, port, proto, mode, sel, strings.Join(e, ","))
}

// Rules the kernel data plane cannot take are refused before an id is
// allocated, with a 4xx class and a reason code; nothing is stored.
func TestPrecheckRefusesWithoutConsumingAnID(t *testing.T) {
	ctx := context.Background()
	st, err := store.OpenBolt(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	c := New(st, lbrule.Settings{}, nil)
	dp := fake.New()
	c.AddReconciler(&KernelReconciler{DP: dp})
	if err := c.Load(ctx); err != nil {
		t.Fatal(err)
	}
	// A rule of another control plane holds 127.0.9.1:80/tcp in the data plane.
	if err := dp.UpsertService(ctx, dataplane.Service{ID: 900, VIP: mustAddr("127.0.9.1"), Port: 80, Proto: "tcp"},
		[]dataplane.Endpoint{{Addr: mustAddr("127.0.9.20"), Port: 80, Healthy: true}}); err != nil {
		t.Fatal(err)
	}
	cases := []struct {
		name, body string
		class      error
		reason     string
	}{
		{"icmp", `{"serviceArguments":{"externalIP":"127.0.9.2","port":0,"protocol":"icmp","mode":0,"sel":0},"endpoints":[{"endpointIP":"127.0.9.10","targetPort":0,"weight":1}]}`, lbrule.ErrInvalid, ReasonL4Protocol},
		{"IPv6 VIP", l4Body("fd00::1", 80, "tcp", 0, 0, "127.0.9.10"), lbrule.ErrInvalid, ReasonL4IPv6},
		{"IPv6 endpoint", l4Body("127.0.9.2", 80, "tcp", 0, 0, "fd00::10"), lbrule.ErrInvalid, ReasonL4IPv6},
		{"SCTP with NAT", l4Body("127.0.9.2", 80, "sctp", 2, 0, "127.0.9.10"), lbrule.ErrInvalid, ReasonL4SCTPNAT},
		{"n3 on an L4 rule", l4Body("127.0.9.2", 2152, "udp", 0, lbrule.SelN3, "127.0.9.10"), lbrule.ErrInvalid, ReasonL4Selector},
		{"multicast endpoint", l4Body("127.0.9.2", 80, "tcp", 0, 0, "224.0.0.5"), lbrule.ErrInvalid, ReasonL4Endpoint},
		{"VIP taken in the data plane", l4Body("127.0.9.1", 80, "tcp", 0, 0, "127.0.9.10"), lbrule.ErrConflict, ReasonVIPConflict},
	}
	for _, tc := range cases {
		_, _, err := c.Create(ctx, []byte(tc.body))
		var re *lbrule.RuleError
		if !errors.As(err, &re) || !errors.Is(err, tc.class) || re.Reason != tc.reason {
			t.Errorf("%s: got %v (reason %q), want class %v reason %s", tc.name, err, reasonOf(err, ""), tc.class, tc.reason)
		}
	}
	svc, created, err := c.Create(ctx, []byte(l4Body("127.0.9.2", 80, "tcp", 0, lbrule.SelCHWBL, "127.0.9.10")))
	if err != nil || !created || svc.ID != 1 {
		t.Fatalf("first valid rule after the refusals: %+v %v %v, want id 1", svc, created, err)
	}
	if got, _, _ := dp.Service(1); got.Sel != dataplane.SelConsistentHash {
		t.Fatalf("chwbl installed with kernel selector %d", got.Sel)
	}
	if recs, _ := st.List(); len(recs) != 1 {
		t.Fatalf("%d rules stored, want 1", len(recs))
	}
}

func mustAddr(s string) netip.Addr { return netip.MustParseAddr(s) }
