package main

import (
	"context"
	"encoding/json"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/loxilb-llm/loxilb/pkg/store"
	"github.com/loxilb-llm/loxilb/pkg/store/etcdtest"
)

// openWith parses args as the daemon does and opens the store they name.
func openWith(t *testing.T, args ...string) (ruleStore, error) {
	t.Helper()
	cfg, err := parseFlags(args, noEnv, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	cfg.store.timeout = 2e9
	st, err := openStore(cfg)
	if err == nil {
		t.Cleanup(func() { st.Close() })
	}
	return st, err
}

func roundTrip(t *testing.T, st ruleStore) {
	t.Helper()
	id, err := st.NextID()
	if err != nil {
		t.Fatal(err)
	}
	if err := st.Put(store.Record{ID: id, Rule: json.RawMessage(`{}`)}, "key/x"); err != nil {
		t.Fatal(err)
	}
	if recs, err := st.List(); err != nil || len(recs) != 1 {
		t.Fatalf("list: %v %v", recs, err)
	}
}

// TestStoreOverTLS: the --store-tls-* flags reach a real etcd that serves
// TLS only and requires client certificates; a missing client certificate
// or a CA that did not sign etcd's certificate stops the daemon at start,
// naming the cluster.
func TestStoreOverTLS(t *testing.T) {
	srv := etcdtest.StartTLS(t)
	url := "etcd://" + srv.Endpoint
	st, err := openWith(t, "--store", url, "--store-tls-ca", srv.TLS.CA, "--store-tls-cert", srv.TLS.ClientCert, "--store-tls-key", srv.TLS.ClientKey)
	if err != nil {
		t.Fatal(err)
	}
	roundTrip(t, st)
	for name, args := range map[string][]string{
		"no client certificate": {"--store", url, "--store-tls-ca", srv.TLS.CA},
		"wrong CA":              {"--store", url, "--store-tls-ca", srv.TLS.OtherCA, "--store-tls-cert", srv.TLS.ClientCert, "--store-tls-key", srv.TLS.ClientKey},
		"plain text":            {"--store", url},
	} {
		if _, err := openWith(t, args...); err == nil || !strings.Contains(err.Error(), srv.Endpoint) {
			t.Errorf("%s: want an error naming %s, got %v", name, srv.Endpoint, err)
		}
	}
}

// TestStoreWithAuth: --store-user and --store-password-file log in to an
// etcd with auth on, limited to its prefix; a wrong password stops the
// daemon at start.
func TestStoreWithAuth(t *testing.T) {
	srv := etcdtest.Start(t)
	cli, err := clientv3.New(clientv3.Config{Endpoints: []string{srv.Endpoint}})
	if err != nil {
		t.Fatal(err)
	}
	defer cli.Close()
	ctx := context.Background()
	steps := []func() error{
		func() error { _, err := cli.UserAdd(ctx, "root", "rootpw"); return err },
		func() error { _, err := cli.UserGrantRole(ctx, "root", "root"); return err },
		func() error { _, err := cli.RoleAdd(ctx, "gateway"); return err },
		func() error {
			_, err := cli.RoleGrantPermission(ctx, "gateway", "/loxilb/", clientv3.GetPrefixRangeEnd("/loxilb/"), clientv3.PermissionType(clientv3.PermReadWrite))
			return err
		},
		func() error { _, err := cli.UserAdd(ctx, "gw", "gwpw"); return err },
		func() error { _, err := cli.UserGrantRole(ctx, "gw", "gateway"); return err },
		func() error { _, err := cli.AuthEnable(ctx); return err },
	}
	for i, f := range steps {
		if err := f(); err != nil {
			t.Fatalf("auth setup step %d: %v", i, err)
		}
	}
	dir := t.TempDir()
	good, bad := filepath.Join(dir, "good"), filepath.Join(dir, "bad")
	os.WriteFile(good, []byte("gwpw\n"), 0o600)
	os.WriteFile(bad, []byte("nope\n"), 0o600)
	url := "etcd://" + srv.Endpoint
	st, err := openWith(t, "--store", url, "--store-user", "gw", "--store-password-file", good)
	if err != nil {
		t.Fatal(err)
	}
	roundTrip(t, st)
	if _, err := openWith(t, "--store", url, "--store-user", "gw", "--store-password-file", bad); err == nil {
		t.Error("wrong password accepted")
	}
	// Outside the granted prefix the user may not read.
	if _, err := openWith(t, "--store", url, "--store-prefix", "/other/", "--store-user", "gw", "--store-password-file", good); err == nil {
		t.Error("read outside the granted prefix accepted")
	}
}
