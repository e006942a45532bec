package proxy

import (
	"net/http"
	"strings"
	"testing"
)

// TestEndpointBodyAndHeader: a candidate's own body and headers replace
// the client's on the request to that endpoint (a data-parallel rank named
// for it), and the client's body still counts as the bytes received.
func TestEndpointBodyAndHeader(t *testing.T) {
	b, _ := echoBackend(t, "b0")
	p := newStaticPicker(hostPort(b))
	rewritten := `{"model":"m","prompt":"hi","routed_dp_rank":1}`
	p.cands[0].Body = []byte(rewritten)
	p.cands[0].Header = http.Header{"X-data-parallel-rank": {"1"}}
	px := startProxy(t, "127.0.0.197", Config{}, Service{}, p)
	req, _ := http.NewRequest("POST", "http://"+px.addr+"/v1/completions", strings.NewReader(`{"model":"m","prompt":"hi"}`))
	req.Header.Set("X-Data-Parallel-Rank", "0")
	resp, err := newClient().Do(req)
	if err != nil {
		t.Fatal(err)
	}
	e := decodeEcho(t, resp)
	if e.Body != rewritten {
		t.Errorf("endpoint got body %q, want %q", e.Body, rewritten)
	}
	if got := e.Header.Values("X-Data-Parallel-Rank"); len(got) != 1 || got[0] != "1" {
		t.Errorf("endpoint got X-Data-Parallel-Rank %q, want only the picker's 1", got)
	}
	if r := p.waitResult(t); r.BytesIn != int64(len(`{"model":"m","prompt":"hi"}`)) {
		t.Errorf("BytesIn %d counts the rewritten body", r.BytesIn)
	}
}
