package proxy

import (
	"bufio"
	"bytes"
	"crypto/tls"
	"io"
	"net"
	"net/http"
	"net/url"
	"reflect"
	"strconv"
	"strings"
	"testing"

	"golang.org/x/net/http/httpguts"
)

// referenceOutbound is the endpoint request as the proxy built it before
// wireRequest, for http.Request.Write to serialise: the differential
// tests below hold wireRequest to the same bytes on the wire.
func referenceOutbound(r *http.Request, ep Endpoint, body []byte) *http.Request {
	if ep.Body != nil {
		body = ep.Body
	}
	h := make(http.Header, len(r.Header)+2+len(ep.Header))
	for k, vv := range r.Header {
		h[k] = vv
	}
	for k, vv := range ep.Header {
		h[http.CanonicalHeaderKey(k)] = vv
	}
	removeHop(h)
	h.Del(HeaderReceiptRequest)
	h.Del("Expect")
	if r.Header.Get("Te") == "trailers" {
		h.Set("Te", "trailers")
	}
	if _, ok := h["User-Agent"]; !ok {
		h["User-Agent"] = []string{""}
	}
	if ip, _, err := net.SplitHostPort(r.RemoteAddr); err == nil {
		if prior := h.Values("X-Forwarded-For"); len(prior) > 0 {
			ip = strings.Join(prior, ", ") + ", " + ip
		}
		h.Set("X-Forwarded-For", ip)
	}
	if r.TLS != nil {
		h["X-Forwarded-Proto"] = []string{"https"}
	} else {
		h["X-Forwarded-Proto"] = []string{"http"}
	}
	var rb io.ReadCloser = http.NoBody
	if len(body) > 0 {
		rb = io.NopCloser(bytes.NewReader(body))
	}
	return &http.Request{
		Method:        r.Method,
		URL:           &url.URL{Scheme: "http", Host: ep.Addr, Path: r.URL.Path, RawPath: r.URL.RawPath, RawQuery: r.URL.RawQuery},
		Proto:         "HTTP/1.1",
		ProtoMajor:    1,
		ProtoMinor:    1,
		Header:        h,
		Body:          rb,
		ContentLength: int64(len(body)),
		Host:          r.Host,
	}
}

// sent is a request as an endpoint parses it.
type sent struct {
	Method, URI, Host string
	Header            http.Header
	Body              string
}

func parseSent(t *testing.T, b []byte) sent {
	t.Helper()
	req, err := http.ReadRequest(bufio.NewReader(bytes.NewReader(b)))
	if err != nil {
		t.Fatalf("endpoint cannot parse %q: %v", b, err)
	}
	body, err := io.ReadAll(req.Body)
	if err != nil {
		t.Fatalf("body of %q: %v", b, err)
	}
	return sent{req.Method, req.RequestURI, req.Host, req.Header, string(body)}
}

// compareWire checks that wireRequest sends what http.Request.Write sent
// for the client request raw; ok is false when raw does not parse.
func compareWire(t *testing.T, raw string, ep Endpoint, https bool) bool {
	t.Helper()
	r, err := http.ReadRequest(bufio.NewReader(strings.NewReader(raw)))
	if err != nil {
		return false
	}
	body, err := io.ReadAll(r.Body)
	if err != nil {
		return false
	}
	// The server in front rejects invalid field values (400) and the
	// endpoint fields are the proxy's own: neither reaches the writer.
	for _, h := range []http.Header{r.Header, ep.Header} {
		for _, vv := range h {
			for _, v := range vv {
				if !httpguts.ValidHeaderFieldValue(v) {
					return true
				}
			}
		}
	}
	r.RemoteAddr = "127.0.0.5:41000"
	if https {
		r.TLS = &tls.ConnectionState{}
	}
	var ref bytes.Buffer
	refErr := referenceOutbound(r, ep, body).Write(&ref)
	var got bytes.Buffer
	bw := bufio.NewWriter(&got)
	w := wireRequest{r: r, ep: ep, body: body, https: https}
	if ep.Body != nil {
		w.body = ep.Body
	}
	gotErr := w.writeRequest(bw)
	_ = bw.Flush()
	if (refErr == nil) != (gotErr == nil) {
		t.Fatalf("request %q: net/http says %v, wireRequest %v", raw, refErr, gotErr)
	}
	if refErr != nil {
		return true
	}
	want, have := parseSent(t, ref.Bytes()), parseSent(t, got.Bytes())
	if !reflect.DeepEqual(want, have) {
		t.Errorf("request %q:\nnet/http sends  %q\nwireRequest sends %q", raw, ref.String(), got.String())
	}
	return true
}

func TestWireRequestMatchesNetHTTP(t *testing.T) {
	post := func(head, body string) string {
		return "POST /v1/completions HTTP/1.1\r\nHost: vip:80\r\n" + head +
			"Content-Length: " + strconv.Itoa(len(body)) + "\r\n\r\n" + body
	}
	cases := []struct {
		name  string
		raw   string
		ep    Endpoint
		https bool
	}{
		{name: "small post", raw: post("Content-Type: application/json\r\n", `{"model":"m"}`)},
		{name: "https", raw: post("", `{}`), https: true},
		{name: "hop fields and connection-named", raw: post("Connection: keep-alive, X-Drop\r\nX-Drop: 1\r\nKeep-Alive: 5\r\nProxy-Authorization: x\r\nUpgrade: h2c\r\nX-Keep: 2\r\n", `{}`)},
		{name: "receipt and expect", raw: post("X-Loxilb-Receipt: 1\r\nExpect: 100-continue\r\n", `{}`)},
		{name: "te trailers", raw: post("Te: trailers\r\n", `{}`)},
		{name: "te other", raw: post("Te: gzip\r\n", `{}`)},
		{name: "user agent", raw: post("User-Agent: curl/8\r\nUser-Agent: second\r\n", `{}`)},
		{name: "empty user agent", raw: post("User-Agent: \r\n", `{}`)},
		{name: "prior forwarded-for", raw: post("X-Forwarded-For: 10.0.0.1\r\nX-Forwarded-For: 10.0.0.2, 10.0.0.3\r\nX-Forwarded-Proto: ftp\r\n", `{}`)},
		{name: "connection names forwarded-for", raw: post("Connection: X-Forwarded-For\r\nX-Forwarded-For: 10.0.0.1\r\n", `{}`)},
		{name: "connection names user-agent", raw: post("Connection: user-agent\r\nUser-Agent: a\r\n", `{}`)},
		{name: "multi-valued", raw: post("Accept: a\r\nAccept: b\r\nX-A: 1\r\n", `{}`)},
		{name: "query and escaped path", raw: "GET /v1/models%2Fx/a%20b?x=1&y=%2F HTTP/1.1\r\nHost: vip\r\n\r\n"},
		{name: "empty query", raw: "GET /v1/models? HTTP/1.1\r\nHost: vip\r\n\r\n"},
		{name: "absolute form", raw: "GET http://other/v1/models?q HTTP/1.1\r\nHost: other\r\n\r\n"},
		{name: "get without body", raw: "GET /health HTTP/1.1\r\nHost: vip\r\n\r\n"},
		{name: "head", raw: "HEAD /health HTTP/1.1\r\nHost: vip\r\n\r\n"},
		{name: "delete without body", raw: "DELETE /x HTTP/1.1\r\nHost: vip\r\n\r\n"},
		{name: "post without body", raw: "POST /x HTTP/1.1\r\nHost: vip\r\nContent-Length: 0\r\n\r\n"},
		{name: "http/1.0 without host", raw: "POST /v1/completions HTTP/1.0\r\nContent-Length: 2\r\n\r\n{}"},
		{name: "chunked body", raw: "POST /v1/completions HTTP/1.1\r\nHost: vip\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n"},
		{name: "ipv6 zone host", raw: "GET / HTTP/1.1\r\nHost: [fe80::1%25en0]:80\r\n\r\n"},
		{name: "endpoint header and body override", raw: post("X-Model: a\r\nx-lower: 1\r\n", `{"a":1}`),
			ep: Endpoint{Addr: "127.0.0.9:80", Header: http.Header{"x-model": {"b"}, "X-Extra": {"v\r\nInjected: 1"}, "Connection": {"X-Extra"}, "Bad Name": {"x"}}, Body: []byte(`{"b":2}`)}},
		{name: "endpoint header only", raw: post("", `{}`), ep: Endpoint{Addr: "127.0.0.9:80", Header: http.Header{"X-Decode": {"1"}, "Te": {"x"}}}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			if c.ep.Addr == "" {
				c.ep.Addr = "127.0.0.9:8000"
			}
			if !compareWire(t, c.raw, c.ep, c.https) {
				t.Fatalf("test request does not parse: %q", c.raw)
			}
		})
	}
}

// FuzzWireRequest holds wireRequest to http.Request.Write for any client
// request the parser accepts and any endpoint header.
func FuzzWireRequest(f *testing.F) {
	f.Add("POST /v1/completions HTTP/1.1\r\nHost: vip\r\nConnection: x-a\r\nX-A: 1\r\nContent-Length: 2\r\n\r\n{}", "X-B", "v")
	f.Add("GET /a%2Fb?c HTTP/1.1\r\nHost: vip\r\nX-Forwarded-For: 1.2.3.4\r\nTe: trailers\r\n\r\n", "connection", "te")
	f.Add("GET / HTTP/1.0\r\n\r\n", "User-Agent", "")
	f.Fuzz(func(t *testing.T, raw, k, v string) {
		ep := Endpoint{Addr: "127.0.0.9:8000"}
		if k != "" {
			ep.Header = http.Header{k: {v}}
		}
		compareWire(t, raw, ep, false)
	})
}
