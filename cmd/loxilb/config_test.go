package main

import (
	"errors"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/loxilb-llm/loxilb/api"
)

func noEnv(string) (string, bool) { return "", false }

// TestAPILimitFlagsValidated: a bad limit stops the daemon naming the flag.
func TestAPILimitFlagsValidated(t *testing.T) {
	for _, c := range []struct{ args []string }{
		{[]string{"--api-read-timeout", "0s"}},
		{[]string{"--api-read-header-timeout", "10m"}},
		{[]string{"--api-write-timeout", "1ms"}},
		{[]string{"--api-idle-timeout", "2h"}},
		{[]string{"--api-max-body", "10"}},
		{[]string{"--api-max-body", "2000000"}},
		{[]string{"--api-max-conns", "0"}},
	} {
		_, err := parseFlags(c.args, noEnv, io.Discard)
		if err == nil || !strings.Contains(err.Error(), c.args[0]) {
			t.Errorf("%v: want an error naming the flag, got %v", c.args, err)
		}
	}
	cfg, err := parseFlags(nil, noEnv, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	a := cfg.apiConfig()
	if a.ReadTimeout != api.DefaultReadTimeout || a.MaxBodyBytes != api.DefaultMaxBodyBytes || a.MaxConns != api.DefaultMaxConns {
		t.Fatalf("defaults not applied: %+v", a)
	}
}

// TestCleartextTokenRefused: a token on a non-loopback address without TLS
// is refused unless --api-allow-cleartext says otherwise.
func TestCleartextTokenRefused(t *testing.T) {
	cfg := &config{apiAddr: "0.0.0.0:11111", apiToken: "t"}
	if err := cfg.apiConfig().Validate(); !errors.Is(err, api.ErrCleartextToken) {
		t.Fatalf("want ErrCleartextToken, got %v", err)
	}
	cfg.api.allowCleartext = true
	if err := cfg.apiConfig().Validate(); err != nil {
		t.Fatal(err)
	}
}

// TestCertificatesLoadedAtStart: a certificate flag naming a bad file, or
// one without its key, stops the daemon naming the flag.
func TestCertificatesLoadedAtStart(t *testing.T) {
	bad := filepath.Join(t.TempDir(), "bad.pem")
	if err := os.WriteFile(bad, []byte("not a certificate"), 0o600); err != nil {
		t.Fatal(err)
	}
	for _, args := range [][]string{
		{"--proxy-tls-cert", bad},
		{"--proxy-tls-cert", bad, "--proxy-tls-key", bad},
		{"--tls-cert", bad, "--tls-key", bad},
	} {
		if _, err := parseFlags(args, noEnv, io.Discard); err == nil || !strings.Contains(err.Error(), args[0]) {
			t.Errorf("%v: want an error naming %s, got %v", args, args[0], err)
		}
	}
}

// TestKVParityStrictFlag: off by default; the environment sets the
// default, the flag wins, and a bad value stops the daemon naming it.
func TestKVParityStrictFlag(t *testing.T) {
	env := func(v string) func(string) (string, bool) {
		return func(k string) (string, bool) {
			if k == "LOXILB_KV_PARITY_STRICT" {
				return v, true
			}
			return "", false
		}
	}
	for _, c := range []struct {
		args []string
		env  string
		want bool
	}{
		{nil, "", false},
		{nil, "true", true},
		{nil, "1", true},
		{[]string{"--kv-parity-strict"}, "", true},
		{[]string{"--kv-parity-strict=false"}, "true", false},
	} {
		cfg, err := parseFlags(c.args, env(c.env), io.Discard)
		if err != nil || cfg.kvParityStrict != c.want {
			t.Errorf("%v env %q: %v %v, want %v", c.args, c.env, cfg != nil && cfg.kvParityStrict, err, c.want)
		}
	}
	if _, err := parseFlags(nil, env("sometimes"), io.Discard); err == nil || !strings.Contains(err.Error(), "LOXILB_KV_PARITY_STRICT") {
		t.Errorf("bad value: %v", err)
	}
}

// TestStoreFlagsValidated: a wrong shared-store option stops the daemon
// naming the flag, before anything is opened.
func TestStoreFlagsValidated(t *testing.T) {
	dir := t.TempDir()
	pw := filepath.Join(dir, "pw")
	if err := os.WriteFile(pw, []byte("secret\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"--store", "etcd://"}, "--store"},
		{[]string{"--store", "redis://h:1"}, "--store"},
		{[]string{"--store", "etcd://h:1", "--store-timeout", "1ms"}, "--store-timeout"},
		{[]string{"--store", "etcd://h:1", "--store-prefix", "loxilb"}, "--store-prefix"},
		{[]string{"--store", "etcd://h:1", "--store-user", "gw"}, "--store-password-file"},
		{[]string{"--store", "etcd://h:1", "--store-tls-cert", pw}, "--store-tls-key"},
		{[]string{"--store", "etcd://h:1", "--store-tls-ca", pw}, "--store-tls-ca"},
		{[]string{"--store", "etcd://h:1", "--store-user", "gw", "--store-password-file", filepath.Join(dir, "missing")}, "--store-password-file"},
	} {
		_, err := parseFlags(c.args, noEnv, io.Discard)
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%v: want an error naming %s, got %v", c.args, c.want, err)
		}
	}
	env := func(k string) (string, bool) {
		v, ok := map[string]string{"LOXILB_STORE": "etcd://127.0.0.1:2379,127.0.0.2:2379", "LOXILB_STORE_USER": "gw", "LOXILB_STORE_PASSWORD_FILE": pw}[k]
		return v, ok
	}
	cfg, err := parseFlags(nil, env, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	ec, err := cfg.store.etcdConfig()
	if err != nil || len(ec.Endpoints) != 2 || ec.Username != "gw" || ec.Password != "secret" || !cfg.proxyConfig().ReusePort {
		t.Fatalf("from the environment: %+v %v", ec, err)
	}
	if cfg, _ := parseFlags(nil, noEnv, io.Discard); cfg.store.shared() || cfg.proxyConfig().ReusePort {
		t.Fatal("default store is not the embedded one")
	}
	// Cluster routing follows the store unless set.
	if !cfg.clusterRoutingOn() {
		t.Fatal("cluster routing should be on with an etcd store")
	}
	if cfg, _ := parseFlags(nil, noEnv, io.Discard); cfg.clusterRoutingOn() {
		t.Fatal("cluster routing should be off alone")
	}
	on := func(k string) (string, bool) {
		if k == "LOXILB_KV_CLUSTER_ROUTING" {
			return "on", true
		}
		return "", false
	}
	if cfg, err := parseFlags(nil, on, io.Discard); err != nil || !cfg.clusterRoutingOn() {
		t.Fatalf("LOXILB_KV_CLUSTER_ROUTING=on alone: %v", err)
	}
	off := func(k string) (string, bool) {
		if k == "LOXILB_KV_CLUSTER_ROUTING" {
			return "off", true
		}
		return env(k)
	}
	if cfg, err := parseFlags(nil, off, io.Discard); err != nil || cfg.clusterRoutingOn() {
		t.Fatalf("LOXILB_KV_CLUSTER_ROUTING=off with etcd: %v", err)
	}
}

// TestClusterFlags: the node name, address and lease are checked at
// start, naming the flag; the address defaults to the API's, with the
// node name for an unspecified host.
func TestClusterFlags(t *testing.T) {
	env := func(m map[string]string) func(string) (string, bool) {
		return func(k string) (string, bool) { v, ok := m[k]; return v, ok }
	}
	c, err := parseFlags([]string{"--node-name", "gw-1", "--api-addr", "0.0.0.0:11111"}, env(nil), io.Discard)
	if err != nil || c.cluster.address != "gw-1:11111" || c.cluster.ttl != 10*time.Second {
		t.Fatalf("%+v %v", c, err)
	}
	c, err = parseFlags([]string{"--node-name", "gw-1"}, env(map[string]string{"LOXILB_CLUSTER_TTL": "3s", "LOXILB_ADVERTISE_ADDR": "gw-1.example:443"}), io.Discard)
	if err != nil || c.cluster.ttl != 3*time.Second || c.cluster.address != "gw-1.example:443" {
		t.Fatalf("%+v %v", c, err)
	}
	for _, tc := range []struct {
		args []string
		env  map[string]string
		want string
	}{
		{[]string{"--node-name", "a/b"}, nil, "--node-name"},
		{[]string{"--node-name", "a", "--cluster-ttl", "1s"}, nil, "--cluster-ttl"},
		{[]string{"--node-name", "a", "--cluster-ttl", "2500ms"}, nil, "--cluster-ttl"},
		{[]string{"--node-name", "a"}, map[string]string{"LOXILB_CLUSTER_TTL": "ten"}, "LOXILB_CLUSTER_TTL"},
		{[]string{"--node-name", "a", "--advertise-addr", "nohostport"}, nil, "--advertise-addr"},
	} {
		if _, err := parseFlags(tc.args, env(tc.env), io.Discard); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%v %v: %v, want an error naming %s", tc.args, tc.env, err, tc.want)
		}
	}
}

// TestRoutingSettingsCompareEffectiveValues: nodes compare what they run,
// so an unset variable and its default spelled out are the same setting,
// and a different value is not.
func TestRoutingSettingsCompareEffectiveValues(t *testing.T) {
	env := func(m map[string]string) func(string) (string, bool) {
		return func(k string) (string, bool) { v, ok := m[k]; return v, ok }
	}
	settings := func(m map[string]string) map[string]string {
		t.Helper()
		c, err := parseFlags(nil, env(m), io.Discard)
		if err != nil {
			t.Fatal(err)
		}
		return c.routingSettings()
	}
	unset := settings(nil)
	spelled := settings(map[string]string{"LLB_KV_MIN_MATCH_TOKENS": "16", "LOXILB_KV_LOAD_PENALTY": "ADAPTIVE", "LOXILB_KV_TIER_WEIGHT_CPU": "0.80"})
	other := settings(map[string]string{"LOXILB_KV_SPILL_RELIEF": "off", "LLB_KV_MIN_MATCH_TOKENS": "32", "LOXILB_KV_PARITY_STRICT": "true"})
	for _, k := range []string{"LLB_KV_MIN_MATCH_TOKENS", "LOXILB_KV_SPILL_RELIEF", "LOXILB_KV_LOAD_PENALTY", "LOXILB_KV_PREFILL_SLOTS", "LOXILB_KV_PARITY_STRICT"} {
		if _, ok := unset[k]; !ok {
			t.Errorf("%s is not compared: %v", k, unset)
		}
	}
	for k, v := range unset {
		if spelled[k] != v {
			t.Errorf("%s: unset %q, default spelled out %q", k, v, spelled[k])
		}
	}
	for _, k := range []string{"LOXILB_KV_SPILL_RELIEF", "LLB_KV_MIN_MATCH_TOKENS", "LOXILB_KV_PARITY_STRICT"} {
		if other[k] == unset[k] {
			t.Errorf("%s changed but compares equal: %q", k, other[k])
		}
	}
}
