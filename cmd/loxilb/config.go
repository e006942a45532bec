package main

import (
	"crypto/tls"
	"crypto/x509"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"strings"
	"time"

	"github.com/loxilb-llm/loxilb/api"
	"github.com/loxilb-llm/loxilb/pkg/dispatch"
	"github.com/loxilb-llm/loxilb/pkg/kvevents"
	"github.com/loxilb-llm/loxilb/pkg/lbrule"
	"github.com/loxilb-llm/loxilb/pkg/outlier"
	"github.com/loxilb-llm/loxilb/pkg/proxy"
	"github.com/loxilb-llm/loxilb/pkg/reconcilers"
	"github.com/loxilb-llm/loxilb/pkg/router"
)

// config is everything the daemon reads at start-up, from the settings
// table (settings_table.go): the environment, then flags, which win. All
// are read once; restart to change.
type config struct {
	apiAddr        string
	apiTokenFile   string
	apiToken       string
	api            apiLimits
	tlsCert        string
	tlsKey         string
	stateDir       string
	tokenizerDir   string
	tokenizerCache int64 // bytes of each staged model's prefix cache
	gcHeapFloor    int64 // bytes the heap may grow between GC cycles (gcfloor)
	interfaces     []string
	noDataplane    bool
	bpfPinPath     string
	metrics        bool
	proxyCert      string
	proxyKey       string
	proxyCA        string
	proxyClient    clientTLS
	maxBodyBytes   int64
	receipts       proxy.ReceiptPolicy
	maxModelName   int
	tokMaxBytes    int
	tokMaxTokens   int
	tokConcurrency int
	bodyCacheBytes int
	proxyLimits    proxyLimits
	resilience     resilience
	outlier        outlier.Config
	store          storeFlags
	cluster        clusterFlags
	scrapeInterval time.Duration
	// kvParityStrict is strict attestation for rules without
	// kvParityStrict (gateway.Config.KVParityStrict).
	kvParityStrict bool
	// clusterRouting is LOXILB_KV_CLUSTER_ROUTING: nil follows the
	// store (on when shared), see clusterRoutingOn.
	clusterRouting *bool
	logLevel       slog.Level
	logJSON        bool
	showVersion    bool
	// table is the settings table the values were read through.
	table []*setting

	// Read by the settings table as text, checked in parseFlags.
	interfacesText, logLevelText, logFormat, receiptsText string

	// seed is LLB_KV_NONE_HASH_SEED, checked per vLLM rule.
	seed string
	// maxBlocks caps each endpoint's inventory (kvindex).
	maxBlocks int
	// kv, router and pd are the event plane's, the Tier-1.5 router's and
	// the P/D dispatcher's settings, complete but for what run adds.
	kv     kvevents.Config
	router router.Config
	pd     dispatch.Config
	// coalesceWait (0: off), prefillSlots (gateway.PrefillAuto: learned)
	// and prefillWait are the gateway's prefill coalescing and admission.
	coalesceWait time.Duration
	prefillSlots int
	prefillWait  time.Duration
	// clusterTieBreak is the cross-node tie-break's deferral (0: off).
	clusterTieBreak time.Duration
	// clusterLoadInterval is how often nodes share their in-flight
	// counts (0: not shared, the scraped estimate only).
	clusterLoadInterval time.Duration
}

// routingSettings are the settings that change where a request goes, by
// environment variable name (each of them has one) with their effective values (every row of the routing
// table, and strict attestation): nodes of one cluster compare them, as
// two nodes that differ route the same request differently.
func (c *config) routingSettings() map[string]string {
	out := map[string]string{}
	for _, s := range c.table {
		if s.table == tabRouting || s.env == "LOXILB_KV_PARITY_STRICT" {
			out[s.env] = s.val.String()
		}
	}
	return out
}

// ruleSettings are the settings rule validation depends on, as read at start.
func (c *config) ruleSettings() lbrule.Settings { return lbrule.Settings{VLLMSeed: c.seed} }

// gatewayCoalesceWait maps the table's 0 (off) onto gateway.Config's
// negative value; gateway.Config's 0 is the default.
// clusterRoutingOn reports whether routing is made consistent across
// gateway nodes (router.Config.ColdRendezvous, gateway.Config.ClusterLoad):
// LOXILB_KV_CLUSTER_ROUTING when set, else on with a shared rule store.
func (c *config) clusterRoutingOn() bool {
	if c.clusterRouting != nil {
		return *c.clusterRouting
	}
	return c.store.shared()
}

func (c *config) gatewayCoalesceWait() time.Duration {
	if c.coalesceWait == 0 {
		return -1
	}
	return c.coalesceWait
}

// dispatchConfig is the P/D dispatcher's configuration: an explicit queue
// depth of 0 (no waiting) is dispatch.Config's negative value, its 0 being
// the default.
func (c *config) dispatchConfig() dispatch.Config {
	d := c.pd
	if d.QueueDepthPerEP == 0 {
		d.QueueDepthPerEP = -1
	}
	return d
}

// clientTLS is the proxy's mutual-TLS material: the certificate it shows
// endpoints, and the CA it verifies clients' certificates against.
type clientTLS struct{ cert, key, ca string }

// loadCAPool reads a PEM CA bundle given by flag, naming flag and file
// when it cannot be read or holds no certificate.
func loadCAPool(flag, file string) (*x509.CertPool, error) {
	pem, err := os.ReadFile(file)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", flag, err)
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(pem) {
		return nil, fmt.Errorf("%s %s holds no PEM certificate", flag, file)
	}
	return pool, nil
}

// apiLimits bound the management API's connections (see api.Config).
type apiLimits struct {
	readHeaderTimeout time.Duration
	readTimeout       time.Duration
	writeTimeout      time.Duration
	idleTimeout       time.Duration
	maxBody           int64
	maxConns          int
	allowCleartext    bool
}

// defaultPinPath is where the data plane pins its maps and links.
const defaultPinPath = "/sys/fs/bpf/loxilb"

func parseFlags(args []string, env func(string) (string, bool), stderr io.Writer) (*config, error) {
	c := &config{}
	fs := flag.NewFlagSet("loxilb", flag.ContinueOnError)
	fs.SetOutput(stderr)
	c.table = c.settings()
	if err := load(fs, c.table, args, env); err != nil {
		return nil, err
	}
	if fs.NArg() > 0 {
		return nil, fmt.Errorf("unexpected arguments: %v", fs.Args())
	}
	// Certificates are loaded once here, so a bad file stops the daemon
	// naming the flag instead of failing every TLS rule (or the API) later.
	for _, kp := range [][4]string{{"--tls-cert", c.tlsCert, "--tls-key", c.tlsKey}, {"--proxy-tls-cert", c.proxyCert, "--proxy-tls-key", c.proxyKey},
		{"--proxy-tls-client-cert", c.proxyClient.cert, "--proxy-tls-client-key", c.proxyClient.key}} {
		if (kp[1] == "") != (kp[3] == "") {
			return nil, fmt.Errorf("%s and %s go together", kp[0], kp[2])
		}
		if kp[1] != "" {
			if _, err := tls.LoadX509KeyPair(kp[1], kp[3]); err != nil {
				return nil, fmt.Errorf("%s %s / %s %s: %w", kp[0], kp[1], kp[2], kp[3], err)
			}
		}
	}
	for _, ca := range [][2]string{{"--proxy-tls-ca", c.proxyCA}, {"--proxy-tls-client-ca", c.proxyClient.ca}} {
		if ca[1] != "" {
			if _, err := loadCAPool(ca[0], ca[1]); err != nil {
				return nil, err
			}
		}
	}
	if err := c.logLevel.UnmarshalText([]byte(c.logLevelText)); err != nil {
		return nil, fmt.Errorf("--log-level %q: want debug, info, warn or error", c.logLevelText)
	}
	switch c.logFormat {
	case "text":
	case "json":
		c.logJSON = true
	default:
		return nil, fmt.Errorf("--log-format %q: want text or json", c.logFormat)
	}
	var err error
	if c.receipts, err = proxy.ParseReceiptPolicy(c.receiptsText); err != nil {
		return nil, fmt.Errorf("--proxy-receipts: %w", err)
	}
	if err := c.proxyLimits.validate(c.maxBodyBytes); err != nil {
		return nil, err
	}
	if c.outlier, err = c.resilience.outlierConfig(); err != nil {
		return nil, err
	}
	for _, i := range strings.Split(c.interfacesText, ",") {
		if i = strings.TrimSpace(i); i != "" {
			c.interfaces = append(c.interfaces, i)
		}
	}
	if c.store.shared() {
		if _, err := c.store.etcdConfig(); err != nil {
			return nil, err
		}
		if _, err := c.store.relayURL(c.apiAddr, c.tlsCert != ""); err != nil {
			return nil, err
		}
	}
	if err := c.cluster.validate(c.apiAddr, c.store.advertise); err != nil {
		return nil, err
	}
	if c.apiTokenFile != "" {
		b, err := os.ReadFile(c.apiTokenFile)
		if err != nil {
			return nil, fmt.Errorf("read --api-token-file: %w", err)
		}
		c.apiToken = strings.TrimSpace(string(b))
		if c.apiToken == "" {
			return nil, errors.New("--api-token-file is empty")
		}
	}
	return c, nil
}

// proxyLimits are the mode-4 proxy's protections against hostile or broken
// clients and endpoints.
type proxyLimits struct {
	responseHeaderTimeout time.Duration
	streamIdleTimeout     time.Duration
	maxResponseHeader     int
	maxInflightBody       int64
	maxConns              int
	abortOnClientClose    bool
}

// validate checks what the table cannot: the body memory of all requests
// holds at least one whole body.
func (l *proxyLimits) validate(maxBody int64) error {
	if l.maxInflightBody < maxBody {
		return fmt.Errorf("--proxy-max-inflight-body %d: want --proxy-max-body (%d) up to 1 TiB", l.maxInflightBody, maxBody)
	}
	return nil
}

// proxyConfig is the process-wide part of the proxy's configuration.
func (c *config) proxyConfig() proxy.Config {
	l := c.proxyLimits
	return proxy.Config{
		MaxBodyBytes:           c.maxBodyBytes,
		ResponseHeaderTimeout:  l.responseHeaderTimeout,
		StreamIdleTimeout:      l.streamIdleTimeout,
		MaxResponseHeaderBytes: l.maxResponseHeader,
		MaxInflightBodyBytes:   l.maxInflightBody,
		MaxConnsPerListener:    l.maxConns,
		AbortOnClientClose:     l.abortOnClientClose,
		ReusePort:              c.store.shared(),
		MaxRetries:             c.resilience.proxyRetries(),
		ShutdownGrace:          max(c.resilience.drainTimeout, time.Nanosecond), // 0 is the proxy's default
	}
}

// listenerConfig is what the mode-4 rules' listeners are built from
// besides the rules: the proxy's knobs, the daemon's TLS files and the
// receipt policy.
func (c *config) listenerConfig() reconcilers.ListenerConfig {
	return reconcilers.ListenerConfig{Proxy: c.proxyConfig(), CertFile: c.proxyCert, KeyFile: c.proxyKey, CAFile: c.proxyCA,
		ClientCertFile: c.proxyClient.cert, ClientKeyFile: c.proxyClient.key, ClientCAFile: c.proxyClient.ca, Receipts: c.receipts}
}

func (c *config) logger(w io.Writer) *slog.Logger {
	opts := &slog.HandlerOptions{Level: c.logLevel}
	if c.logJSON {
		return slog.New(slog.NewJSONHandler(w, opts))
	}
	return slog.New(slog.NewTextHandler(w, opts))
}

// apiConfig is the management server's configuration.
func (c *config) apiConfig() api.Config {
	return api.Config{Addr: c.apiAddr, Token: c.apiToken, TLSCert: c.tlsCert, TLSKey: c.tlsKey, AllowCleartext: c.api.allowCleartext,
		MetricsEnabled: c.metrics, Version: version,
		ReadHeaderTimeout: c.api.readHeaderTimeout, ReadTimeout: c.api.readTimeout, WriteTimeout: c.api.writeTimeout,
		IdleTimeout: c.api.idleTimeout, MaxBodyBytes: c.api.maxBody, MaxConns: c.api.maxConns}
}
