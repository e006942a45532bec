package main

import (
	"context"
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/loxilb-llm/loxilb/testbed/enginesim"
	"github.com/loxilb-llm/loxilb/testbed/fleet"
)

// TestCLIDiagnostics: against the real daemon and an emulated vLLM engine,
// get diagnostics exits 0 for a rule whose endpoint is healthy and 8 with
// a FAIL line and its fix for a rule whose endpoint's ZMQ port is closed.
func TestCLIDiagnostics(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	f, err := fleet.Start(ctx, []enginesim.Config{{Engine: enginesim.EngineVLLM, Seed: "12345", TimeScaleSet: true}}, fleet.Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer f.Stop()
	m := f.Members[0]
	d := startDaemon(t, t.TempDir(), []string{"LLB_KV_NONE_HASH_SEED=12345"})
	host, port, _ := strings.Cut(m.Addr, ":")
	create := func(vip, epIP string) {
		body := fmt.Sprintf(`{"serviceArguments":{"externalIP":%q,"port":2097,"protocol":"tcp","mode":4,"kvExactMode":3,"kvEngineType":"vllm","kvZmqPort":%d},`+
			`"endpoints":[{"endpointIP":%q,"targetPort":%s,"weight":1}]}`, vip, m.ZMQPorts[0], epIP, port)
		resp, err := http.Post(d.URL("/config/loadbalancer"), "application/json", strings.NewReader(body))
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != 200 {
			t.Fatalf("create %s: %d\n%s", vip, resp.StatusCode, d.Logs())
		}
	}
	create("127.0.0.50", host)        // service 1: the engine
	create("127.0.0.51", "127.0.0.2") // service 2: nothing listens there

	out, errs, code := cli(t, d.Port, "get", "diagnostics", "--service", "2")
	if code != exitCheckFailed || !strings.Contains(out, "FAIL    zmq_port") || !strings.Contains(out, "127.0.0.2:") || !strings.Contains(errs, "check failed") {
		t.Fatalf("closed ZMQ port: exit %d\n%s%s", code, out, errs)
	}
	// The healthy rule passes once its subscriber has connected.
	deadline := time.Now().Add(15 * time.Second)
	for {
		out, errs, code = cli(t, d.Port, "get", "diagnostics", "--service", "1")
		if code == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("healthy endpoint: exit %d\n%s%s", code, out, errs)
		}
		time.Sleep(200 * time.Millisecond)
	}
	if !strings.Contains(out, "PASS    zmq_port") || strings.Contains(out, "FAIL") {
		t.Errorf("healthy endpoint:\n%s", out)
	}
	// Every rule at once: the closed port fails the whole report.
	if _, _, code = cli(t, d.Port, "get", "diagnostics", "-o", "json"); code != exitCheckFailed {
		t.Errorf("all rules: exit %d", code)
	}
	if _, _, code = cli(t, d.Port, "get", "diagnostics", "--service", "9"); code != exitPrecondition {
		t.Errorf("unknown service: exit %d", code)
	}
}
