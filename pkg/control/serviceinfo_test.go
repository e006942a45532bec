package control

import (
	"context"
	"strconv"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus/testutil"
)

func TestServiceInfoMapsIDToRuleName(t *testing.T) {
	c, _, _ := newCtl(t, t.TempDir())
	svc, _, err := c.Create(context.Background(), []byte(body))
	if err != nil {
		t.Fatal(err)
	}
	want := `
# HELP loxilb_service_info Always 1, one series per rule: maps the numeric service label of every other metric to the rule's name, VIP, port, protocol and mode.
# TYPE loxilb_service_info gauge
loxilb_service_info{mode="4",name="chat",port="2090",protocol="tcp",service="` + strconv.FormatUint(uint64(svc.ID), 10) + `",vip="127.0.0.10"} 1
`
	if err := testutil.CollectAndCompare(ServiceInfoCollector(c), strings.NewReader(want), "loxilb_service_info"); err != nil {
		t.Fatal(err)
	}
}
