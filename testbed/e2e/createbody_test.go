package e2e

import (
	"bytes"
	"encoding/json"
	"io"
	"net"
	"net/http"
	"strings"
	"testing"

	"github.com/loxilb-llm/loxilb/testbed/daemontest"
)

// postRaw posts body exactly as given (post would re-encode it).
func postRaw(t *testing.T, url, body string) {
	t.Helper()
	resp, err := http.Post(url, "application/json", strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != 200 {
		b, _ := io.ReadAll(resp.Body)
		t.Fatalf("create rule: %d %s", resp.StatusCode, b)
	}
}

func getRaw(t *testing.T, url string) []byte {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil || resp.StatusCode != 200 {
		t.Fatalf("GET %s: %d %v %s", url, resp.StatusCode, err, b)
	}
	return b
}

// TestCreateBodyAcrossRestart: rules created with unusual but valid
// formatting (keys out of order, tabs, CRLF, spaces before colons, an
// escaped character) read back byte for byte from the real daemon, after
// a restart too, including a rule that is stored but failed because its
// VIP:port is held by another process when the daemon comes back.
func TestCreateBodyAcrossRestart(t *testing.T) {
	bodies := []string{
		"{\"endpoints\" : [ {\"weight\":1 , \"targetPort\":28410,\"endpointIP\":\"127.0.203.10\"} ],\r\n\t\"serviceArguments\":{\"sel\":0,\"mode\":4,  \"protocol\":\"tcp\",\"port\":28401,\"externalIP\":\"127.0.203.1\",\"name\":\"b\\u006fdy-a\"}\n}",
		"{\n    \"serviceArguments\": {\n        \"name\": \"body-b\",\n        \"externalIP\": \"127.0.203.2\",\n        \"port\": 28401,\n        \"protocol\": \"tcp\",\n        \"mode\": 4\n    },\n    \"endpoints\": [\n        {\"endpointIP\": \"127.0.203.10\", \"targetPort\": 28410, \"weight\": 1}\n    ]\n}",
	}
	state := t.TempDir()
	d := daemontest.Start(t, bins, state, nil)
	for _, b := range bodies {
		postRaw(t, d.URL("/config/loadbalancer"), b)
	}
	check := func(d *daemontest.Daemon, when string, wantFailed bool) {
		t.Helper()
		raw := getRaw(t, d.URL("/config/loadbalancer/all?body=true"))
		for _, b := range bodies {
			if !bytes.Contains(raw, []byte(`"createBody":`+b+`}`)) {
				t.Errorf("%s: body not returned verbatim; want inside the response\n%s\ngot\n%s", when, b, raw)
			}
		}
		var list struct {
			LBAttr []struct {
				Status *struct {
					State      string `json:"state"`
					ReasonCode string `json:"reason_code"`
				} `json:"ruleStatus"`
				CreateBody json.RawMessage `json:"createBody"`
			} `json:"lbAttr"`
		}
		if err := json.Unmarshal(raw, &list); err != nil || len(list.LBAttr) != 2 {
			t.Fatalf("%s: decode %v\n%s", when, err, raw)
		}
		for i, b := range bodies {
			if !bytes.Equal(list.LBAttr[i].CreateBody, []byte(b)) {
				t.Errorf("%s: rule %d body\n%q\nwant\n%q", when, i, list.LBAttr[i].CreateBody, b)
			}
		}
		st := list.LBAttr[1].Status
		if failed := st != nil && st.State == "failed" && st.ReasonCode == "VIP_PORT_IN_USE"; failed != wantFailed {
			t.Errorf("%s: held rule status %+v, want failed=%v", when, st, wantFailed)
		}
	}
	check(d, "before the restart", false)
	d.Stop()

	holder, err := net.Listen("tcp", "127.0.203.2:28401")
	if err != nil {
		t.Fatal(err)
	}
	defer holder.Close()
	d = daemontest.Start(t, bins, state, nil)
	check(d, "after the restart", true)

	out, errs, code := daemontest.CLI(t, bins, d.Port, "get", "lb", "--show-body")
	if code != 0 {
		t.Fatalf("get lb --show-body: exit %d %s", code, errs)
	}
	want := "# service 1 127.0.203.1:28401/tcp body-a applied\n" + bodies[0] + "\n" +
		"# service 2 127.0.203.2:28401/tcp body-b failed:VIP_PORT_IN_USE\n" + bodies[1] + "\n"
	if out != want {
		t.Errorf("get lb --show-body:\n%s\nwant\n%s", out, want)
	}
}
