// Package client is the typed Go client of the management API, used by
// loxicmd and by end-to-end tests. It speaks only HTTP to the daemon.
package client

import (
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"os"
	"strconv"
	"time"

	"github.com/loxilb-llm/loxilb/api"
	"github.com/loxilb-llm/loxilb/pkg/cluster"
	"github.com/loxilb-llm/loxilb/pkg/lbrule"
)

// Config locates and authenticates the daemon.
type Config struct {
	Server   string // host, default 127.0.0.1
	Port     int    // default 11111
	Protocol string // http or https
	Token    string
	Timeout  time.Duration
	CACert   string // PEM file to verify the daemon's certificate
	Insecure bool   // skip certificate verification (lab use only)
}

// Client talks to one daemon.
type Client struct {
	base  string
	token string
	hc    *http.Client
}

// ErrUnavailable wraps transport failures (daemon down, timeout, TLS).
var ErrUnavailable = errors.New("daemon unavailable")

// APIError is an error answer from the daemon.
type APIError struct {
	Status int
	Body   api.ErrorBody
}

func (e *APIError) Error() string {
	msg := e.Body.Message
	if msg == "" {
		msg = http.StatusText(e.Status)
	}
	if e.Body.ReasonCode != "" {
		return fmt.Sprintf("HTTP %d %s: %s", e.Status, e.Body.ReasonCode, msg)
	}
	return fmt.Sprintf("HTTP %d: %s", e.Status, msg)
}

// New builds a client.
func New(cfg Config) (*Client, error) {
	if cfg.Server == "" {
		cfg.Server = "127.0.0.1"
	}
	if cfg.Port == 0 {
		cfg.Port = 11111
	}
	if cfg.Protocol == "" {
		cfg.Protocol = "http"
	}
	if cfg.Protocol != "http" && cfg.Protocol != "https" {
		return nil, fmt.Errorf("protocol %q: want http or https", cfg.Protocol)
	}
	if cfg.Timeout == 0 {
		cfg.Timeout = 10 * time.Second
	}
	tr := &http.Transport{Proxy: nil}
	if cfg.Protocol == "https" {
		tc := &tls.Config{InsecureSkipVerify: cfg.Insecure} //nolint:gosec // explicit operator opt-in
		if cfg.CACert != "" {
			pem, err := os.ReadFile(cfg.CACert)
			if err != nil {
				return nil, fmt.Errorf("read CA file: %w", err)
			}
			pool := x509.NewCertPool()
			if !pool.AppendCertsFromPEM(pem) {
				return nil, fmt.Errorf("CA file %s holds no PEM certificate", cfg.CACert)
			}
			tc.RootCAs = pool
		}
		tr.TLSClientConfig = tc
	}
	host := net.JoinHostPort(cfg.Server, strconv.Itoa(cfg.Port))
	return &Client{base: cfg.Protocol + "://" + host + api.BasePath, token: cfg.Token, hc: &http.Client{Timeout: cfg.Timeout, Transport: tr}}, nil
}

func (c *Client) do(ctx context.Context, method, path string, body []byte, out any) error {
	var rd io.Reader
	if body != nil {
		rd = bytes.NewReader(body)
	}
	req, err := http.NewRequestWithContext(ctx, method, c.base+path, rd)
	if err != nil {
		return err
	}
	if body != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	if c.token != "" {
		req.Header.Set("Authorization", "Bearer "+c.token)
	}
	resp, err := c.hc.Do(req)
	if err != nil {
		return fmt.Errorf("%w: %v", ErrUnavailable, err)
	}
	defer resp.Body.Close()
	data, err := io.ReadAll(io.LimitReader(resp.Body, 64<<20))
	if err != nil {
		return fmt.Errorf("%w: read response: %v", ErrUnavailable, err)
	}
	if resp.StatusCode/100 != 2 {
		e := &APIError{Status: resp.StatusCode}
		_ = json.Unmarshal(data, &e.Body)
		return e
	}
	if out == nil {
		return nil
	}
	if raw, ok := out.(*[]byte); ok {
		*raw = data
		return nil
	}
	if err := json.Unmarshal(data, out); err != nil {
		return fmt.Errorf("decode %s response: %w", path, err)
	}
	return nil
}

// CreateLB posts a rule.
func (c *Client) CreateLB(ctx context.Context, r *lbrule.Rule) (api.ResultBody, error) {
	body, err := json.Marshal(r)
	if err != nil {
		return api.ResultBody{}, err
	}
	return c.CreateLBRaw(ctx, body)
}

// CreateLBRaw posts a rule body as given.
func (c *Client) CreateLBRaw(ctx context.Context, body []byte) (api.ResultBody, error) {
	var out api.ResultBody
	err := c.do(ctx, http.MethodPost, "/config/loadbalancer", body, &out)
	return out, err
}

// ListLB lists the rules.
func (c *Client) ListLB(ctx context.Context) (api.LBList, error) {
	var out api.LBList
	err := c.do(ctx, http.MethodGet, "/config/loadbalancer/all", nil, &out)
	return out, err
}

// ListLBWithBodies lists the rules with each one's stored create body
// (createBody). It also returns the response as received, where the
// bodies are the exact stored bytes.
func (c *Client) ListLBWithBodies(ctx context.Context) (api.LBList, []byte, error) {
	var raw []byte
	if err := c.do(ctx, http.MethodGet, "/config/loadbalancer/all?body=true", nil, &raw); err != nil {
		return api.LBList{}, nil, err
	}
	var out api.LBList
	if err := json.Unmarshal(raw, &out); err != nil {
		return api.LBList{}, nil, fmt.Errorf("decode /config/loadbalancer/all response: %w", err)
	}
	return out, raw, nil
}

// DeleteLB deletes the rule ip:port/proto.
func (c *Client) DeleteLB(ctx context.Context, ip string, port int, proto string) error {
	p := fmt.Sprintf("/config/loadbalancer/externalipaddress/%s/port/%d/protocol/%s", url.PathEscape(ip), port, url.PathEscape(proto))
	return c.do(ctx, http.MethodDelete, p, nil, nil)
}

// DeleteLBByName deletes every rule named name.
func (c *Client) DeleteLBByName(ctx context.Context, name string) (api.ResultBody, error) {
	var out api.ResultBody
	err := c.do(ctx, http.MethodDelete, "/config/loadbalancer/name/"+url.PathEscape(name), nil, &out)
	return out, err
}

// Capabilities reads the capability entries.
func (c *Client) Capabilities(ctx context.Context) (api.Capabilities, error) {
	var out api.Capabilities
	err := c.do(ctx, http.MethodGet, "/status/capabilities", nil, &out)
	return out, err
}

// Inventory reads one endpoint's KV inventory.
func (c *Client) Inventory(ctx context.Context, service uint32, ep, limit int) (api.Inventory, error) {
	var out api.Inventory
	err := c.do(ctx, http.MethodGet, fmt.Sprintf("/config/ai/kv/inventory?service_id=%d&ep_idx=%d&limit=%d", service, ep, limit), nil, &out)
	return out, err
}

// Diagnostics runs the daemon's preflight checks of every KV-exact rule,
// or of service only when only is true.
func (c *Client) Diagnostics(ctx context.Context, service uint32, only bool) (api.Diagnostics, error) {
	var out api.Diagnostics
	path := api.DiagnosticsPath
	if only {
		path += fmt.Sprintf("?service=%d", service)
	}
	err := c.do(ctx, http.MethodGet, path, nil, &out)
	return out, err
}

// Cluster lists the gateway nodes sharing the daemon's rule store and the
// settings on which they drift.
func (c *Client) Cluster(ctx context.Context) (cluster.View, error) {
	var out cluster.View
	err := c.do(ctx, http.MethodGet, api.ClusterPath, nil, &out)
	return out, err
}

// SetMetrics enables or disables the metrics export.
func (c *Client) SetMetrics(ctx context.Context, on bool) error {
	m := http.MethodPost
	if !on {
		m = http.MethodDelete
	}
	return c.do(ctx, m, "/config/metrics", nil, nil)
}

// Metrics returns the Prometheus text exposition.
func (c *Client) Metrics(ctx context.Context) (string, error) {
	var raw []byte
	err := c.do(ctx, http.MethodGet, "/metrics", nil, &raw)
	return string(raw), err
}

// DrainPath is the API path of one endpoint's maintenance state.
func DrainPath(ip string, port int, proto string, block int, epIP string, epPort int) string {
	p := fmt.Sprintf("/config/loadbalancer/externalipaddress/%s/port/%d/protocol/%s/endpoint/%s/port/%d/drain",
		url.PathEscape(ip), port, url.PathEscape(proto), url.PathEscape(epIP), epPort)
	if block != 0 {
		p += fmt.Sprintf("?block=%d", block)
	}
	return p
}

// SetDrain puts an endpoint of the rule ip:port/proto (mark block) in
// maintenance (on) or back in service, and returns its state.
func (c *Client) SetDrain(ctx context.Context, ip string, port int, proto string, block int, epIP string, epPort int, on bool) (api.EndpointDrain, error) {
	m := http.MethodPost
	if !on {
		m = http.MethodDelete
	}
	var out api.EndpointDrain
	err := c.do(ctx, m, DrainPath(ip, port, proto, block, epIP, epPort), nil, &out)
	return out, err
}

// Drain reads an endpoint's maintenance state.
func (c *Client) Drain(ctx context.Context, ip string, port int, proto string, block int, epIP string, epPort int) (api.EndpointDrain, error) {
	var out api.EndpointDrain
	err := c.do(ctx, http.MethodGet, DrainPath(ip, port, proto, block, epIP, epPort), nil, &out)
	return out, err
}
