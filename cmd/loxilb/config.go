package main

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"strings"
	"time"

	"github.com/loxilb-llm/loxilb/pkg/proxy"
)

// config is everything the daemon reads at start-up: flags first, then the
// documented environment variables. All are read once; restart to change.
type config struct {
	apiAddr        string
	apiTokenFile   string
	apiToken       string
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
	maxBodyBytes   int64
	proxyLimits    proxyLimits
	scrapeInterval time.Duration
	logLevel       slog.Level
	logJSON        bool
	showVersion    bool
}

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
	var ifaces, level, format string
	fs.StringVar(&c.apiAddr, "api-addr", getenv("LOXILB_API_ADDR", "127.0.0.1:11111"), "management API listen address (a non-loopback address requires a token)")
	fs.StringVar(&c.apiTokenFile, "api-token-file", getenv("LOXILB_API_TOKEN_FILE", ""), "file holding the bearer token required on every API route (env LOXILB_API_TOKEN_FILE)")
	fs.StringVar(&c.tlsCert, "tls-cert", "", "serve the API over HTTPS with this certificate (PEM)")
	fs.StringVar(&c.tlsKey, "tls-key", "", "private key (PEM) for --tls-cert")
	fs.StringVar(&c.stateDir, "state-dir", getenv("LOXILB_STATE_DIR", "/var/lib/loxilb"), "directory of the embedded rule store")
	fs.StringVar(&c.tokenizerDir, "tokenizer-dir", getenv("LOXILB_TOKENIZER_DIR", "/etc/loxilb/tokenizers"), "staged tokenizers: <dir>/<model-slug>/tokenizer.json")
	fs.StringVar(&ifaces, "interfaces", "", "comma-separated interfaces the eBPF data plane attaches to (none by default)")
	fs.BoolVar(&c.noDataplane, "no-dataplane", false, "run proxy-only: never load BPF programs")
	fs.StringVar(&c.bpfPinPath, "bpf-pin-path", "/sys/fs/bpf/loxilb", "bpffs directory where data-plane maps are pinned")
	fs.StringVar(&c.proxyCert, "proxy-tls-cert", "", "certificate (PEM) served by mode-4 rules with security 1 or 2")
	fs.StringVar(&c.proxyKey, "proxy-tls-key", "", "private key (PEM) for --proxy-tls-cert")
	fs.StringVar(&c.proxyCA, "proxy-tls-ca", "", "CA (PEM) that endpoint certificates are verified against for security 2 (default: system roots)")
	fs.Int64Var(&c.maxBodyBytes, "proxy-max-body", 32<<20, "largest request body the mode-4 proxy accepts (413 beyond)")
	c.proxyLimits.register(fs)
	fs.DurationVar(&c.scrapeInterval, "engine-metrics-interval", time.Second, "how often mode-4 endpoints' /metrics are read for load-aware routing")
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
	if err := c.proxyLimits.validate(c.maxBodyBytes); err != nil {
		return nil, err
	}
	for _, i := range strings.Split(ifaces, ",") {
		if i = strings.TrimSpace(i); i != "" {
			c.interfaces = append(c.interfaces, i)
		}
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
	}
}

func (c *config) logger(w io.Writer) *slog.Logger {
	opts := &slog.HandlerOptions{Level: c.logLevel}
	if c.logJSON {
		return slog.New(slog.NewJSONHandler(w, opts))
	}
	return slog.New(slog.NewTextHandler(w, opts))
}
