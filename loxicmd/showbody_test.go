package main

import (
	"bytes"
	"encoding/json"
	"net/http"
	"strings"
	"testing"

	"github.com/loxilb-llm/loxilb/api"
	"github.com/loxilb-llm/loxilb/pkg/lbrule"
)

// TestPrintLBBodies: a header per rule, then its body as received; a rule
// without a stored body says so.
func TestPrintLBBodies(t *testing.T) {
	var out bytes.Buffer
	list := api.LBList{LBAttr: []lbrule.Rule{
		{ServiceID: 3, Service: lbrule.ServiceArgs{ExternalIP: "::1", Port: 80, Protocol: "tcp", Name: "x"},
			Status: &lbrule.Status{State: "failed", ReasonCode: "VIP_PORT_IN_USE"}, CreateBody: json.RawMessage("{ \"a\" :1 }")},
		{ServiceID: 4, Service: lbrule.ServiceArgs{ExternalIP: "127.0.0.1", Port: 81, Protocol: "udp"}},
	}}
	printLBBodies(&globalOpts{out: &out}, list)
	want := "# service 3 [::1]:80/tcp x failed:VIP_PORT_IN_USE\n{ \"a\" :1 }\n# service 4 127.0.0.1:81/udp - -\n# (no stored create body)\n"
	if out.String() != want {
		t.Errorf("got\n%s\nwant\n%s", out.String(), want)
	}
}

// TestCLIShowBody: get lb --show-body against the real daemon prints the
// body as posted; -o json prints the daemon's response, bodies verbatim.
func TestCLIShowBody(t *testing.T) {
	d := startDaemon(t, t.TempDir(), nil)
	body := "{ \"serviceArguments\" :{\"port\":2091,\"externalIP\":\"127.0.0.40\",\"mode\":4,\"protocol\":\"tcp\"},\n  \"endpoints\":[{\"endpointIP\":\"127.0.0.41\",\"targetPort\":30000,\"weight\":1}]}"
	resp, err := http.Post(d.URL("/config/loadbalancer"), "application/json", strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != 200 {
		t.Fatalf("create: %d", resp.StatusCode)
	}
	out, errs, code := cli(t, d.Port, "get", "lb", "--show-body")
	if want := "# service 1 127.0.0.40:2091/tcp - applied\n" + body + "\n"; code != 0 || out != want {
		t.Errorf("get lb --show-body: exit %d %s\n%s\nwant\n%s", code, errs, out, want)
	}
	out, _, code = cli(t, d.Port, "get", "lb", "--show-body", "-o", "json")
	if code != 0 || !strings.Contains(out, `"createBody":`+body+`}`) || !json.Valid([]byte(out)) {
		t.Errorf("get lb --show-body -o json: exit %d\n%s", code, out)
	}
	if out, _, _ = cli(t, d.Port, "get", "lb"); strings.Contains(out, "serviceArguments") {
		t.Errorf("get lb without --show-body prints bodies:\n%s", out)
	}
}
