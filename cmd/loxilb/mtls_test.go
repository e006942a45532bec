package main

import (
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/loxilb-llm/loxilb/testbed/pki"
)

// TestProxyMutualTLSFlags: the client certificate, key and client CA come
// from flags or LOXILB_PROXY_TLS_CLIENT_*, reach the gateway (whose rules
// give them to the proxy's upstream, which P/D legs use too), and a bad
// file stops the daemon naming flag and file.
func TestProxyMutualTLSFlags(t *testing.T) {
	dir := t.TempDir()
	authority := pki.New(t)
	cert, key, _ := authority.Leaf(t, "client")
	ca := authority.File
	bad := filepath.Join(dir, "bad.pem")
	if err := os.WriteFile(bad, []byte("not PEM"), 0o600); err != nil {
		t.Fatal(err)
	}
	missing := filepath.Join(dir, "missing.pem")

	cfg, err := parseFlags([]string{"--proxy-tls-client-cert", cert, "--proxy-tls-client-key", key, "--proxy-tls-client-ca", ca}, noEnv, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	if cfg.proxyClient != (clientTLS{cert, key, ca}) {
		t.Fatalf("flags: %+v", cfg.proxyClient)
	}
	env := func(k string) (string, bool) {
		v, ok := map[string]string{"LOXILB_PROXY_TLS_CLIENT_CERT": cert, "LOXILB_PROXY_TLS_CLIENT_KEY": key, "LOXILB_PROXY_TLS_CLIENT_CA": ca}[k]
		return v, ok
	}
	if cfg, err = parseFlags(nil, env, io.Discard); err != nil || cfg.proxyClient != (clientTLS{cert, key, ca}) {
		t.Fatalf("environment: %+v %v", cfg, err)
	}

	for _, c := range []struct {
		args       []string
		flag, file string
	}{
		{[]string{"--proxy-tls-client-cert", cert}, "--proxy-tls-client-cert", ""},
		{[]string{"--proxy-tls-client-cert", bad, "--proxy-tls-client-key", key}, "--proxy-tls-client-cert", bad},
		{[]string{"--proxy-tls-client-cert", cert, "--proxy-tls-client-key", missing}, "--proxy-tls-client-key", missing},
		{[]string{"--proxy-tls-client-ca", bad}, "--proxy-tls-client-ca", bad},
		{[]string{"--proxy-tls-client-ca", missing}, "--proxy-tls-client-ca", missing},
		{[]string{"--proxy-tls-ca", bad}, "--proxy-tls-ca", bad},
	} {
		_, err := parseFlags(c.args, noEnv, io.Discard)
		if err == nil || !strings.Contains(err.Error(), c.flag) || !strings.Contains(err.Error(), c.file) {
			t.Errorf("%v: want an error naming %s %s, got %v", c.args, c.flag, c.file, err)
		}
	}
}
