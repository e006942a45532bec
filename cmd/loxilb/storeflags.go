package main

import (
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"strings"
	"time"

	"github.com/loxilb-llm/loxilb/api"
	"github.com/loxilb-llm/loxilb/pkg/kvevents"
	"github.com/loxilb-llm/loxilb/pkg/store"
)

// storeFlags choose the rule store: the embedded bbolt file (one node) or
// a shared etcd cluster (several nodes serving one rule set).
type storeFlags struct {
	url          string
	prefix       string
	tlsCA        string
	tlsCert      string
	tlsKey       string
	user         string
	passwordFile string
	timeout      time.Duration
	// advertise is host:port where the other nodes reach this node's
	// management API (membership, the TensorRT-LLM drain relay); "" means
	// --api-addr.
	advertise string
	// drainTTL is the lease of a TensorRT-LLM drain ownership: how long
	// a crashed owner's endpoints go undrained before another node takes
	// them.
	drainTTL time.Duration
}

// relayURL is this node's relay stream URL as the other nodes reach it,
// checked when the store is shared.
func (s *storeFlags) relayURL(apiAddr string, https bool) (string, error) {
	flag, hp := "--advertise-addr", s.advertise
	if hp == "" {
		flag, hp = "--api-addr", apiAddr
	}
	host, port, err := net.SplitHostPort(hp)
	if err != nil {
		return "", fmt.Errorf("%s %q: %w", flag, hp, err)
	}
	if ip := net.ParseIP(host); host == "" || (ip != nil && ip.IsUnspecified()) {
		return "", fmt.Errorf("%s %q names no host the other nodes can reach: set --advertise-addr", flag, hp)
	}
	scheme := "http://"
	if https {
		scheme = "https://"
	}
	return scheme + net.JoinHostPort(host, port) + api.BasePath + api.KVRelayPath, nil
}

// shared reports whether the rule store is shared by several nodes.
func (s *storeFlags) shared() bool { return s.url != "bolt" }

// etcdConfig validates the etcd options and reads their files, naming the
// flag that is wrong.
func (s *storeFlags) etcdConfig() (store.EtcdConfig, error) {
	var cfg store.EtcdConfig
	eps, err := store.ParseEtcdURL(s.url)
	if err != nil {
		return cfg, fmt.Errorf("--store: %w", err)
	}
	if s.drainTTL%time.Second != 0 {
		return cfg, fmt.Errorf("--trt-drain-lease-ttl %v: want whole seconds", s.drainTTL)
	}
	if !strings.HasPrefix(s.prefix, "/") {
		return cfg, fmt.Errorf("--store-prefix %q: want a key prefix starting with /", s.prefix)
	}
	cfg = store.EtcdConfig{Endpoints: eps, Prefix: s.prefix, OpTimeout: s.timeout, Username: s.user}
	if (s.user == "") != (s.passwordFile == "") {
		return cfg, errors.New("--store-user and --store-password-file go together")
	}
	if s.passwordFile != "" {
		b, err := os.ReadFile(s.passwordFile)
		if err != nil {
			return cfg, fmt.Errorf("--store-password-file: %w", err)
		}
		if cfg.Password = strings.TrimRight(string(b), "\r\n"); cfg.Password == "" {
			return cfg, errors.New("--store-password-file is empty")
		}
	}
	if (s.tlsCert == "") != (s.tlsKey == "") {
		return cfg, errors.New("--store-tls-cert and --store-tls-key go together")
	}
	if s.tlsCA == "" && s.tlsCert == "" {
		return cfg, nil
	}
	tc := &tls.Config{MinVersion: tls.VersionTLS12}
	if s.tlsCA != "" {
		pem, err := os.ReadFile(s.tlsCA)
		if err != nil {
			return cfg, fmt.Errorf("--store-tls-ca: %w", err)
		}
		tc.RootCAs = x509.NewCertPool()
		if !tc.RootCAs.AppendCertsFromPEM(pem) {
			return cfg, fmt.Errorf("--store-tls-ca %s holds no PEM certificate", s.tlsCA)
		}
	}
	if s.tlsCert != "" {
		kp, err := tls.LoadX509KeyPair(s.tlsCert, s.tlsKey)
		if err != nil {
			return cfg, fmt.Errorf("--store-tls-cert %s / --store-tls-key %s: %w", s.tlsCert, s.tlsKey, err)
		}
		tc.Certificates = []tls.Certificate{kp}
	}
	cfg.TLS = tc
	return cfg, nil
}

// ruleStore is what the daemon needs of a store: the rules and the API's
// settings.
type ruleStore interface {
	store.Store
	api.Settings
}

// openStore opens the store the flags name.
func openStore(cfg *config) (ruleStore, error) {
	if !cfg.store.shared() {
		return store.OpenBolt(cfg.stateDir)
	}
	ec, err := cfg.store.etcdConfig()
	if err != nil {
		return nil, err
	}
	return store.OpenEtcd(ec)
}

// storeCap is the "rule_store" capability: which backend, and whether it
// can be reached (writes are refused while it cannot).
func storeCap(st store.Store) api.Capability {
	h := st.Health()
	c := api.Capability{Name: "rule_store", Ready: h.Up, Reason: h.Backend + " " + h.Where}
	if !h.Up {
		c.ReasonCode = "store_unreachable"
		c.Reason = fmt.Sprintf("%s %s unreachable since %s: %s; the rules already applied keep serving, rule changes are refused (503) until it is back",
			h.Backend, h.Where, h.Since.UTC().Format(time.RFC3339), h.Err)
	}
	return c
}

// drainRelay sets up the TensorRT-LLM drain elections and relay of a node
// on an etcd store: the elections use the store's client, the relay is
// reached at this node's advertised API address with the cluster's API
// token (the nodes share it) and, when the API serves HTTPS, verified
// against the system roots plus the certificates of --tls-cert (the nodes
// share a certificate or its CA).
func drainRelay(cfg *config, st ruleStore, kv *kvevents.Config) error {
	e, ok := st.(*store.Etcd)
	if !ok {
		return nil
	}
	u, err := cfg.store.relayURL(cfg.apiAddr, cfg.tlsCert != "")
	if err != nil {
		return err
	}
	kv.Drain, kv.RelayURL, kv.NodeName, kv.RelayToken = e.DrainElection(cfg.store.drainTTL), u, u, cfg.apiToken
	if cfg.tlsCert == "" {
		return nil
	}
	roots, err := x509.SystemCertPool()
	if err != nil {
		roots = x509.NewCertPool()
	}
	pem, err := os.ReadFile(cfg.tlsCert)
	if err != nil {
		return fmt.Errorf("--tls-cert: %w", err)
	}
	roots.AppendCertsFromPEM(pem)
	tr := http.DefaultTransport.(*http.Transport).Clone()
	tr.TLSClientConfig = &tls.Config{MinVersion: tls.VersionTLS12, RootCAs: roots}
	tr.ResponseHeaderTimeout = 30 * time.Second
	kv.RelayClient = &http.Client{Transport: tr}
	return nil
}
