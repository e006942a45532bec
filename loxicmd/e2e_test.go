package main

import (
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/loxilb-llm/loxilb/testbed/daemontest"
)

// These tests drive the real daemon process with the real CLI binary.

var bins *daemontest.Binaries

func TestMain(m *testing.M) { os.Exit(daemontest.Main(m, &bins)) }

func startDaemon(t *testing.T, stateDir string, env []string, args ...string) *daemontest.Daemon {
	return daemontest.Start(t, bins, stateDir, env, args...)
}

func cli(t *testing.T, port int, args ...string) (string, string, int) {
	return daemontest.CLI(t, bins, port, args...)
}

// The three loxicmd lines of the spec, with documentation addresses replaced
// by loopback ones so no packet ever leaves the machine.
var specLines = [][]string{
	strings.Fields("create lb 127.0.0.10 --tcp=2090:30000 --endpoints=127.0.0.11:1,127.0.0.12:1 --mode=fullproxy --select=chwbl --kv-exact-mode=3 --kv-engine-type=sglang --kv-dp-ranks=1 --kv-zmq-port=5557 --kv-block-size=16 --kv-warmup=30"),
	strings.Fields("create lb 127.0.0.254 --tcp=8080:8080 --endpoints=127.0.1.1:1,127.0.2.1:1,127.0.3.1:1,127.0.1.101:1,127.0.2.101:1,127.0.3.101:1 --mode=fullproxy --pd-disagg --kv-exact-mode=1 --kv-zmq-port=5557 --kv-hash-algo=sha256_cbor --kv-warmup=30 --kv-block-size=16 --ep-role=prefill,decode,prefill,decode,prefill,decode"),
	strings.Fields("create lb 127.0.0.254 --tcp=9090:8080 --endpoints=127.0.2.101:1,127.0.3.101:1,127.0.1.102:1 --mode=fullproxy --kv-exact-mode=3 --kv-engine-type=sglang --kv-dp-ranks=3 --kv-zmq-port=5561 --kv-warmup=30 --kv-block-size=16"),
}

func TestCLIEndToEnd(t *testing.T) {
	state := t.TempDir()
	d := startDaemon(t, state, []string{"LLB_KV_NONE_HASH_SEED=12345"})
	port := d.Port
	for _, line := range specLines {
		out, errs, code := cli(t, port, line...)
		if code != 0 || !strings.Contains(out, "created rule") {
			t.Fatalf("%v: exit %d\n%s%s\ndaemon:\n%s", line, code, out, errs, d.Logs())
		}
	}
	out, _, code := cli(t, port, "get", "lb")
	if code != 0 || strings.Count(out, "fullproxy") != 3 || !strings.Contains(out, "sglang/exact=3/sha256_sglang/bs=16") || !strings.Contains(out, "vllm/exact=1/sha256_cbor/bs=16/pd") {
		t.Fatalf("get lb table:\n%s", out)
	}
	out, _, _ = cli(t, port, "get", "lb", "-o", "wide")
	if strings.Count(out, "prefill") != 3 || strings.Count(out, "decode") != 3 {
		t.Errorf("wide output lacks roles:\n%s", out)
	}
	out, _, code = cli(t, port, "get", "lb", "-o", "json")
	var list struct {
		LBAttr []struct {
			ServiceID uint32         `json:"serviceID"`
			Service   map[string]any `json:"serviceArguments"`
		} `json:"lbAttr"`
	}
	if err := json.Unmarshal([]byte(out), &list); err != nil || code != 0 || len(list.LBAttr) != 3 {
		t.Fatalf("json: %v\n%s", err, out)
	}
	if s := list.LBAttr[2].Service; s["kvDpRankCount"] != 3.0 || s["kvZmqPort"] != 5561.0 || s["kvWarmupSec"] != 30.0 {
		t.Errorf("KV fields not echoed: %v", s)
	}

	// Invalid input: non-zero exit with the server's message.
	_, errs, code := cli(t, port, "create", "lb", "127.0.0.20", "--tcp=80:8080", "--endpoints=127.0.0.21:1", "--mode=fullproxy", "--kv-exact-mode=3", "--kv-engine-type=sglang", "--kv-dp-ranks=9")
	if code != exitInvalid || !strings.Contains(errs, "kvDpRankCount") || !strings.Contains(errs, "1..8") {
		t.Errorf("invalid create: exit %d stderr %q", code, errs)
	}
	_, errs, code = cli(t, port, "create", "lb", "127.0.0.20", "--tcp=80", "--endpoints=127.0.0.21:1")
	if code != exitUsage || !strings.Contains(errs, "PORT:TARGETPORT") {
		t.Errorf("usage error: exit %d stderr %q", code, errs)
	}
	_, _, code = cli(t, port, specLines[0]...)
	if code != exitPrecondition {
		t.Errorf("duplicate create: exit %d, want %d", code, exitPrecondition)
	}

	// Restart: rules survive unchanged.
	d.Stop()
	port = startDaemon(t, state, []string{"LLB_KV_NONE_HASH_SEED=12345"}).Port
	out2, _, _ := cli(t, port, "get", "lb", "-o", "json")
	if out2 != out {
		t.Errorf("rules changed across restart:\nbefore %s\nafter %s", out, out2)
	}

	// Deletes by key and by name.
	if out, errs, code := cli(t, port, "delete", "lb", "127.0.0.254", "--tcp=9090"); code != 0 {
		t.Fatalf("delete: %d %s %s", code, out, errs)
	}
	if _, _, code := cli(t, port, "delete", "lb", "127.0.0.254", "--tcp=9090"); code != exitPrecondition {
		t.Errorf("delete missing: exit %d", code)
	}
	// Without the eBPF data plane an L4 rule cannot be served: refused, not silently accepted.
	if _, errs, code := cli(t, port, "create", "lb", "127.0.0.30", "--tcp=81:8081", "--endpoints=127.0.0.31:1", "--name=web"); code != exitPrecondition || !strings.Contains(errs, "EBPF_DATAPLANE_UNAVAILABLE") {
		t.Fatalf("L4 rule without data plane: exit %d %q", code, errs)
	}
	if _, _, code := cli(t, port, "create", "lb", "127.0.0.30", "--tcp=81:8081", "--endpoints=127.0.0.31:1", "--name=web", "--mode=fullproxy"); code != 0 {
		t.Fatal("create named")
	}
	if out, _, code := cli(t, port, "delete", "lb", "--name=web"); code != 0 || !strings.Contains(out, "deleted 1") {
		t.Errorf("delete by name: %d %s", code, out)
	}
	out, _, _ = cli(t, port, "get", "capabilities")
	if !strings.Contains(out, "kv_exact_vllm") || !strings.Contains(out, "true") {
		t.Errorf("capabilities:\n%s", out)
	}
}

func TestCLIPreconditionAndAuth(t *testing.T) {
	dir := t.TempDir()
	tokenFile := filepath.Join(dir, "token")
	if err := os.WriteFile(tokenFile, []byte("s3cret\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	port := startDaemon(t, t.TempDir(), nil, "--api-token-file", tokenFile).Port
	if _, errs, code := cli(t, port, "get", "lb"); code != exitAuth || !strings.Contains(errs, "401") {
		t.Errorf("no token: exit %d %q", code, errs)
	}
	bad := filepath.Join(dir, "bad")
	_ = os.WriteFile(bad, []byte("nope"), 0o600)
	if _, errs, code := cli(t, port, "--token-file", bad, "get", "lb"); code != exitAuth || !strings.Contains(errs, "403") {
		t.Errorf("bad token: exit %d %q", code, errs)
	}
	// No seed in the daemon's environment: vLLM KV-exact is a precondition failure.
	_, errs, code := cli(t, port, append([]string{"--token-file", tokenFile}, specLines[1]...)...)
	if code != exitPrecondition || !strings.Contains(errs, "KV_EXACT_SEED_UNSET") {
		t.Errorf("seed precondition: exit %d %q", code, errs)
	}
	out, _, _ := cli(t, port, "--token-file", tokenFile, "get", "capabilities", "-o", "json")
	if !strings.Contains(out, `"reason_code": "KV_EXACT_SEED_UNSET"`) {
		t.Errorf("capabilities: %s", out)
	}
	if _, _, code := cli(t, port, append([]string{"--token-file", tokenFile}, specLines[0]...)...); code != 0 {
		t.Errorf("sglang rule needs no seed: exit %d", code)
	}
}

func TestCLIUnavailable(t *testing.T) {
	if _, errs, code := cli(t, daemontest.FreePort(t), "get", "lb"); code != exitUnavailable || !strings.Contains(errs, "unavailable") {
		t.Errorf("daemon down: exit %d %q", code, errs)
	}
}

func TestKVToolsOffline(t *testing.T) {
	out, _, code := cli(t, 1, "kv", "tokenize", "--tokenizer-dir", "../testdata/tokenizers", "--model", "Qwen/Qwen3-0.6B", "--prompt", "Hello, world!")
	if code != 0 || strings.TrimSpace(out) != `{"ids":[9707,11,1879,0]}` {
		t.Errorf("tokenize: %d %q", code, out)
	}
	out, _, code = cli(t, 1, "kv", "hash", "--engine", "sglang", "--block-size", "2", "--tokens", "1,2,3,4,5")
	var keys struct{ Keys []int64 }
	if err := json.Unmarshal([]byte(out), &keys); err != nil || code != 0 || len(keys.Keys) != 2 {
		t.Errorf("hash: %d %q %v", code, out, err)
	}
	if _, errs, code := cli(t, 1, "kv", "hash", "--engine", "sglang", "--algo", "sha256_cbor", "--tokens", "1"); code != exitUsage || !strings.Contains(errs, "incompatible") {
		t.Errorf("incoherent algo: %d %q", code, errs)
	}
	out, _, code = cli(t, 1, "kv", "hash", "--engine", "vllm", "--seed", "12345", "--model", "Qwen/Qwen3-0.6B", "--tokenizer-dir", "../testdata/tokenizers",
		"--prompt", strings.Repeat("The quick brown fox jumps over the lazy dog. ", 8))
	if err := json.Unmarshal([]byte(out), &keys); code != 0 || err != nil || len(keys.Keys) == 0 {
		// vLLM keys are unsigned and may exceed int64; decode loosely.
		var loose struct{ Keys []json.Number }
		if err2 := json.Unmarshal([]byte(out), &loose); err2 != nil || len(loose.Keys) == 0 {
			t.Errorf("hash of prompt: %d %q", code, out)
		}
	}
}
