package api_test

import (
	"bytes"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"testing"

	"github.com/loxilb-llm/loxilb/api"
	"github.com/loxilb-llm/loxilb/pkg/control"
	"github.com/loxilb-llm/loxilb/pkg/lbrule"
	"github.com/loxilb-llm/loxilb/pkg/store"
)

func getRaw(t *testing.T, ts *httptest.Server, path string) (int, []byte) {
	t.Helper()
	resp, err := http.Get(ts.URL + api.BasePath + path)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return resp.StatusCode, b
}

// reformat rewrites a seed body with its keys swapped and odd but valid
// whitespace around them.
func reformat(t *testing.T, seed string) string {
	var m map[string]json.RawMessage
	if err := json.Unmarshal([]byte(seed), &m); err != nil {
		t.Fatal(err)
	}
	return "  {\n\t\"endpoints\"  :  " + string(m["endpoints"]) + " ,\r\n   \"serviceArguments\":" + string(m["serviceArguments"]) + "\n}\n"
}

// TestCreateBodyReadBack: ?body=true returns each rule's create body byte
// for byte, across a restart, for a rule that failed to load as well.
func TestCreateBodyReadBack(t *testing.T) {
	dir := t.TempDir()
	serve := func(seed string) (*httptest.Server, *store.Bolt) {
		st, err := store.OpenBolt(dir)
		if err != nil {
			t.Fatal(err)
		}
		ctl := control.New(st, lbrule.Settings{VLLMSeed: seed}, nil)
		_ = ctl.Load(t.Context()) // a rule that fails to load is listed, failed
		srv, err := api.New(api.Config{}, api.Deps{Rules: ctl})
		if err != nil {
			t.Fatal(err)
		}
		ts := httptest.NewServer(srv.Handler())
		t.Cleanup(ts.Close)
		return ts, st
	}
	ts, st := serve("12345")
	sglang := reformat(t, readSeed(t, "seed_sglang_single.json"))
	vllm := reformat(t, readSeed(t, "seed_vllm_pd.json"))
	for _, b := range []string{sglang, vllm} {
		if code, m := do(t, ts, "POST", "/config/loadbalancer", b); code != 200 {
			t.Fatalf("create: %d %v", code, m)
		}
	}
	check := func(wantFailed bool) {
		t.Helper()
		code, raw := getRaw(t, ts, "/config/loadbalancer/all?body=true")
		if code != 200 {
			t.Fatalf("list with bodies: %d %s", code, raw)
		}
		for _, b := range []string{sglang, vllm} {
			if !bytes.Contains(raw, []byte(`"createBody":`+b+`}`)) {
				t.Errorf("response lacks the body verbatim:\n%s\nwant inside:\n%q", raw, b)
			}
		}
		var list api.LBList
		if err := json.Unmarshal(raw, &list); err != nil || len(list.LBAttr) != 2 {
			t.Fatalf("decode: %v\n%s", err, raw)
		}
		for i, b := range []string{sglang, vllm} {
			if got := string(list.LBAttr[i].CreateBody); got != string(bytes.TrimSpace([]byte(b))) {
				t.Errorf("rule %d body %q, want %q", i, got, b)
			}
		}
		if failed := list.LBAttr[1].Status != nil && list.LBAttr[1].Status.State == control.StateFailed; failed != wantFailed {
			t.Errorf("vLLM rule status %+v, want failed=%v", list.LBAttr[1].Status, wantFailed)
		}
	}
	check(false)
	if _, raw := getRaw(t, ts, "/config/loadbalancer/all"); bytes.Contains(raw, []byte("createBody")) {
		t.Errorf("plain listing carries bodies: %s", raw)
	}
	if code, _ := getRaw(t, ts, "/config/loadbalancer/all?body=false"); code != 200 {
		t.Errorf("body=false: %d", code)
	}
	if code, m := do(t, ts, "GET", "/config/loadbalancer/all?body=maybe", ""); code != 400 || m["message"] == nil {
		t.Errorf("body=maybe: %d %v", code, m)
	}

	// Restart without the seed: the vLLM rule is stored but failed, and
	// both bodies still read back byte for byte.
	ts.Close()
	st.Close()
	ts, st = serve("")
	defer st.Close()
	check(true)

	// A read-back entry with its createBody re-posts: the field is ignored.
	var list api.LBList
	_, raw := getRaw(t, ts, "/config/loadbalancer/all?body=true")
	if err := json.Unmarshal(raw, &list); err != nil {
		t.Fatal(err)
	}
	again, _ := json.Marshal(list.LBAttr[0])
	if code, m := do(t, ts, "POST", "/config/loadbalancer", string(again)); code != 409 || m["reason_code"] != control.ReasonDuplicate {
		t.Errorf("re-post of a read-back entry: %d %v", code, m)
	}
}
