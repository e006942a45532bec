package main

import (
	"errors"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"

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
