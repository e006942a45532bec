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
	"strconv"
	"strings"
	"time"

	"github.com/loxilb-llm/loxilb/api"
	"github.com/loxilb-llm/loxilb/pkg/lbrule"
	"github.com/loxilb-llm/loxilb/pkg/outlier"
	"github.com/loxilb-llm/loxilb/pkg/proxy"
)

// config is everything the daemon reads at start-up: flags first, then the
// documented environment variables. All are read once; restart to change.
type config struct {
	apiAddr        string
	apiTokenFile   string
	apiToken       string
	api            apiLimits
	tlsCert        string
	tlsKey         string
	stateDir       string
	tokenizerDir   string
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
	proxyLimits    proxyLimits
	resilience     resilience
	outlier        outlier.Config
	store          storeFlags
	cluster        clusterFlags
	scrapeInterval time.Duration
	// kvParityStrict is strict attestation for rules without
	// kvParityStrict (gateway.Config.KVParityStrict).
	kvParityStrict bool
	logLevel       slog.Level
	logJSON        bool
	showVersion    bool
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
	getenv := func(k, def string) string {
		if v, ok := env(k); ok && v != "" {
			return v
		}
		return def
	}
	var ifaces, level, format, receipts string
	strictDef := false
	if v := getenv("LOXILB_KV_PARITY_STRICT", ""); v != "" {
		b, err := strconv.ParseBool(v)
		if err != nil {
			return nil, fmt.Errorf("LOXILB_KV_PARITY_STRICT=%q: want true or false (1, 0, t, f)", v)
		}
		strictDef = b
	}
	fs.StringVar(&c.apiAddr, "api-addr", getenv("LOXILB_API_ADDR", "127.0.0.1:11111"), "management API listen address (a non-loopback address requires a token)")
	fs.StringVar(&c.apiTokenFile, "api-token-file", getenv("LOXILB_API_TOKEN_FILE", ""), "file holding the bearer token required on every API route (env LOXILB_API_TOKEN_FILE)")
	fs.DurationVar(&c.api.readHeaderTimeout, "api-read-header-timeout", api.DefaultReadHeaderTimeout, "management API: time a client has to send a request's headers (100ms..5m)")
	fs.DurationVar(&c.api.readTimeout, "api-read-timeout", api.DefaultReadTimeout, "management API: time a client has to send a whole request, body included; slower bodies get 408 (100ms..1h)")
	fs.DurationVar(&c.api.writeTimeout, "api-write-timeout", api.DefaultWriteTimeout, "management API: time to write a response to a client (1s..1h)")
	fs.DurationVar(&c.api.idleTimeout, "api-idle-timeout", api.DefaultIdleTimeout, "management API: how long an idle keep-alive connection is kept (1s..1h)")
	fs.Int64Var(&c.api.maxBody, "api-max-body", api.DefaultMaxBodyBytes, "management API: largest request body in bytes; larger ones get 413 unread (1024..1048576)")
	fs.IntVar(&c.api.maxConns, "api-max-conns", api.DefaultMaxConns, "management API: connections open at once; more are closed at accept (1..65536)")
	fs.BoolVar(&c.api.allowCleartext, "api-allow-cleartext", false, "accept a bearer token over plain HTTP on a non-loopback --api-addr (otherwise --tls-cert is required there)")
	fs.StringVar(&c.tlsCert, "tls-cert", "", "serve the API over HTTPS with this certificate (PEM)")
	fs.StringVar(&c.tlsKey, "tls-key", "", "private key (PEM) for --tls-cert")
	fs.StringVar(&c.stateDir, "state-dir", getenv("LOXILB_STATE_DIR", "/var/lib/loxilb"), "directory of the embedded rule store")
	fs.StringVar(&c.tokenizerDir, "tokenizer-dir", getenv("LOXILB_TOKENIZER_DIR", "/etc/loxilb/tokenizers"), "staged tokenizers: <dir>/<model-slug>/tokenizer.json")
	fs.StringVar(&ifaces, "interfaces", "", "comma-separated interfaces the eBPF data plane attaches to (none by default)")
	fs.BoolVar(&c.noDataplane, "no-dataplane", false, "run proxy-only: never load BPF programs")
	fs.StringVar(&c.bpfPinPath, "bpf-pin-path", defaultPinPath, "bpffs directory where data-plane maps and links are pinned; one daemon per directory (a second refuses to start)")
	fs.StringVar(&c.proxyCert, "proxy-tls-cert", "", "certificate (PEM) served by mode-4 rules with security 1 or 2")
	fs.StringVar(&c.proxyKey, "proxy-tls-key", "", "private key (PEM) for --proxy-tls-cert")
	fs.StringVar(&c.proxyCA, "proxy-tls-ca", "", "CA (PEM) that endpoint certificates are verified against for security 2 (default: system roots)")
	fs.StringVar(&c.proxyClient.cert, "proxy-tls-client-cert", getenv("LOXILB_PROXY_TLS_CLIENT_CERT", ""), "client certificate (PEM) presented to endpoints of security 2 rules (backend mTLS); a rule's mtls_backend client_cert_path replaces it (env LOXILB_PROXY_TLS_CLIENT_CERT)")
	fs.StringVar(&c.proxyClient.key, "proxy-tls-client-key", getenv("LOXILB_PROXY_TLS_CLIENT_KEY", ""), "private key (PEM) for --proxy-tls-client-cert (env LOXILB_PROXY_TLS_CLIENT_KEY)")
	fs.StringVar(&c.proxyClient.ca, "proxy-tls-client-ca", getenv("LOXILB_PROXY_TLS_CLIENT_CA", ""), "CA bundle (PEM) that client certificates are verified against at the VIP of rules whose mtls_frontend client_cert_mode is optional or required and names no CA (env LOXILB_PROXY_TLS_CLIENT_CA)")
	fs.Int64Var(&c.maxBodyBytes, "proxy-max-body", 32<<20, "largest request body the mode-4 proxy accepts (413 beyond)")
	fs.StringVar(&receipts, "proxy-receipts", getenv("LOXILB_PROXY_RECEIPTS", "off"), "when mode-4 responses carry the X-Loxilb-Route routing receipt: off, on-request (X-Loxilb-Receipt: 1) or always; a receipt shows any client what other clients' prompts left cached (env LOXILB_PROXY_RECEIPTS)")
	fs.IntVar(&c.maxModelName, "proxy-max-model-name", 256, "longest model name a mode-4 request may carry, in bytes (1..65536; 400 beyond)")
	fs.IntVar(&c.tokMaxBytes, "tokenize-max-bytes", 1<<20, "longest prompt text (a completions prompt or the rendered chat) tokenized for one request, in bytes (1024..268435456; 400 beyond)")
	fs.IntVar(&c.tokMaxTokens, "tokenize-max-tokens", 0, "most prompt tokens per request (1..16777216; 400 beyond); 0: the model's context length from its staged config.json or tokenizer_config.json, else 262144")
	fs.IntVar(&c.tokConcurrency, "tokenize-concurrency", 0, "requests tokenized at once; the others wait while their client does (1..1024; 0: one per CPU, GOMAXPROCS)")
	c.proxyLimits.register(fs)
	c.resilience.register(fs, env)
	c.store.register(fs, getenv)
	c.cluster.register(fs, getenv)
	fs.DurationVar(&c.scrapeInterval, "engine-metrics-interval", time.Second, "how often mode-4 endpoints' /metrics are read for load-aware routing")
	fs.BoolVar(&c.kvParityStrict, "kv-parity-strict", strictDef, "strict attestation for rules that do not set kvParityStrict: an endpoint whose hash-parity verdict is hash_mismatch, block_size_mismatch or hash_algo_mismatch gets no Tier-1.5 traffic (env LOXILB_KV_PARITY_STRICT)")
	fs.BoolVar(&c.metrics, "metrics", false, "enable the Prometheus export at start (otherwise POST /netlox/v1/config/metrics)")
	fs.StringVar(&level, "log-level", "info", "debug, info, warn or error")
	fs.StringVar(&format, "log-format", "text", "text or json")
	fs.BoolVar(&c.showVersion, "version", false, "print the version and exit")
	if err := fs.Parse(args); err != nil {
		return nil, err
	}
	if fs.NArg() > 0 {
		return nil, fmt.Errorf("unexpected arguments: %v", fs.Args())
	}
	if err := c.api.validate(); err != nil {
		return nil, err
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
	if err := c.logLevel.UnmarshalText([]byte(level)); err != nil {
		return nil, fmt.Errorf("--log-level %q: want debug, info, warn or error", level)
	}
	switch format {
	case "text":
	case "json":
		c.logJSON = true
	default:
		return nil, fmt.Errorf("--log-format %q: want text or json", format)
	}
	var err error
	if c.receipts, err = proxy.ParseReceiptPolicy(receipts); err != nil {
		return nil, fmt.Errorf("--proxy-receipts: %w", err)
	}
	for _, b := range []struct {
		name     string
		v        int
		min, max int
		zeroOK   bool
	}{
		{"--proxy-max-model-name", c.maxModelName, 1, 65536, false},
		{"--tokenize-max-bytes", c.tokMaxBytes, 1024, 256 << 20, false},
		{"--tokenize-max-tokens", c.tokMaxTokens, 1, 1 << 24, true},
		{"--tokenize-concurrency", c.tokConcurrency, 1, 1024, true},
	} {
		if (b.v < b.min || b.v > b.max) && !(b.zeroOK && b.v == 0) {
			zero := ""
			if b.zeroOK {
				zero = " or 0"
			}
			return nil, fmt.Errorf("%s %d: want %d..%d%s", b.name, b.v, b.min, b.max, zero)
		}
	}
	if err := c.proxyLimits.validate(c.maxBodyBytes); err != nil {
		return nil, err
	}
	if c.outlier, err = c.resilience.outlierConfig(func(k string) string { v, _ := env(k); return v }); err != nil {
		return nil, err
	}
	for _, i := range strings.Split(ifaces, ",") {
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

func (l *proxyLimits) register(fs *flag.FlagSet) {
	fs.DurationVar(&l.responseHeaderTimeout, "proxy-response-header-timeout", proxy.DefaultResponseHeaderTimeout,
		"how long a mode-4 endpoint may take to send its response headers, and then its first body byte (504 beyond); long prompts behind a busy engine's queue need minutes")
	fs.DurationVar(&l.streamIdleTimeout, "proxy-stream-idle-timeout", proxy.DefaultStreamIdleTimeout,
		"a mode-4 response whose endpoint sends no byte for this long once its body started is cut")
	fs.IntVar(&l.maxResponseHeader, "proxy-max-response-header", proxy.DefaultMaxResponseHeaderBytes,
		"largest response header block (bytes) accepted from a mode-4 or P/D endpoint (502 beyond)")
	fs.Int64Var(&l.maxInflightBody, "proxy-max-inflight-body", proxy.DefaultMaxInflightBodyBytes,
		"bytes all mode-4 request bodies being read or relayed may hold together (503 with Retry-After beyond); at least --proxy-max-body")
	fs.IntVar(&l.maxConns, "proxy-max-conns", proxy.DefaultMaxConnsPerListener,
		"client connections one mode-4 listener keeps open; more are closed at accept")
	fs.BoolVar(&l.abortOnClientClose, "proxy-abort-on-client-close", false,
		"cancel a mode-4 request as soon as its client half-closes (frees the engine sooner; a client that half-closes and still reads then gets no answer)")
}

// validate rejects values that would disable a protection or could never
// work, naming the flag.
func (l *proxyLimits) validate(maxBody int64) error {
	switch {
	case maxBody < 1:
		return fmt.Errorf("--proxy-max-body %d: want at least 1 byte", maxBody)
	case l.responseHeaderTimeout < time.Second || l.responseHeaderTimeout > 24*time.Hour:
		return fmt.Errorf("--proxy-response-header-timeout %v: want 1s..24h", l.responseHeaderTimeout)
	case l.streamIdleTimeout < time.Second || l.streamIdleTimeout > 24*time.Hour:
		return fmt.Errorf("--proxy-stream-idle-timeout %v: want 1s..24h", l.streamIdleTimeout)
	case l.maxResponseHeader < 4<<10 || l.maxResponseHeader > 64<<20:
		return fmt.Errorf("--proxy-max-response-header %d: want 4096..67108864 bytes", l.maxResponseHeader)
	case l.maxInflightBody < maxBody || l.maxInflightBody > 1<<40:
		return fmt.Errorf("--proxy-max-inflight-body %d: want --proxy-max-body (%d) up to 1 TiB", l.maxInflightBody, maxBody)
	case l.maxConns < 1 || l.maxConns > 1<<20:
		return fmt.Errorf("--proxy-max-conns %d: want 1..1048576", l.maxConns)
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

func (c *config) logger(w io.Writer) *slog.Logger {
	opts := &slog.HandlerOptions{Level: c.logLevel}
	if c.logJSON {
		return slog.New(slog.NewJSONHandler(w, opts))
	}
	return slog.New(slog.NewTextHandler(w, opts))
}

func (a apiLimits) validate() error {
	for _, d := range []struct {
		flag   string
		v      time.Duration
		lo, hi time.Duration
	}{
		{"--api-read-header-timeout", a.readHeaderTimeout, 100 * time.Millisecond, 5 * time.Minute},
		{"--api-read-timeout", a.readTimeout, 100 * time.Millisecond, time.Hour},
		{"--api-write-timeout", a.writeTimeout, time.Second, time.Hour},
		{"--api-idle-timeout", a.idleTimeout, time.Second, time.Hour},
	} {
		if d.v < d.lo || d.v > d.hi {
			return fmt.Errorf("%s %v: want a duration in %v..%v", d.flag, d.v, d.lo, d.hi)
		}
	}
	if a.maxBody < 1024 || a.maxBody > lbrule.MaxBodyBytes {
		return fmt.Errorf("--api-max-body %d: want 1024..%d bytes (no rule body is larger)", a.maxBody, lbrule.MaxBodyBytes)
	}
	if a.maxConns < 1 || a.maxConns > 65536 {
		return fmt.Errorf("--api-max-conns %d: want 1..65536", a.maxConns)
	}
	return nil
}

// apiConfig is the management server's configuration.
func (c *config) apiConfig() api.Config {
	return api.Config{Addr: c.apiAddr, Token: c.apiToken, TLSCert: c.tlsCert, TLSKey: c.tlsKey, AllowCleartext: c.api.allowCleartext,
		MetricsEnabled: c.metrics, Version: version,
		ReadHeaderTimeout: c.api.readHeaderTimeout, ReadTimeout: c.api.readTimeout, WriteTimeout: c.api.writeTimeout,
		IdleTimeout: c.api.idleTimeout, MaxBodyBytes: c.api.maxBody, MaxConns: c.api.maxConns}
}
