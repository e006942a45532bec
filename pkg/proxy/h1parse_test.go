package proxy

import (
	"bufio"
	"bytes"
	"encoding/json"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"reflect"
	"strings"
	"testing"
	"time"
)

// h1Case is one request head (and body) of the conformance and smuggling
// corpus, with what the lean parser must make of it and whether net/http's
// server accepts it. Where the two differ on purpose, note says why.
type h1Case struct {
	name    string
	raw     string
	verdict h1Verdict
	reason  string
	netOK   bool // net/http's server answers it (not 4xx/5xx)
	note    string
}

var h1Corpus = []h1Case{
	{name: "get", raw: "GET /v1/models HTTP/1.1\r\nHost: vip\r\n\r\n", verdict: h1OK, netOK: true},
	{name: "post-cl", raw: "POST /v1/completions HTTP/1.1\r\nHost: vip\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}", verdict: h1OK, netOK: true},
	{name: "query", raw: "GET /a/b;c=d?x=1&y=%2F#frag HTTP/1.1\r\nHost: vip:8080\r\n\r\n", verdict: h1OK, netOK: true},
	{name: "lowercase-names", raw: "POST / HTTP/1.1\r\nhost: vip\r\ncontent-length: 1\r\nx-some-THING: v\r\n\r\na", verdict: h1OK, netOK: true},
	{name: "duplicate-field", raw: "GET / HTTP/1.1\r\nHost: vip\r\nX-A: 1\r\nX-A: 2\r\nx-a: 3\r\n\r\n", verdict: h1OK, netOK: true},
	{name: "ows-trimmed", raw: "GET / HTTP/1.1\r\nHost: vip\r\nX-A: \t a \t b \t\r\nX-Empty:\r\n\r\n", verdict: h1OK, netOK: true},
	{name: "obs-text", raw: "GET / HTTP/1.1\r\nHost: vip\r\nX-A: caf\xc3\xa9\r\n\r\n", verdict: h1OK, netOK: true},
	{name: "lowercase-method", raw: "get / HTTP/1.1\r\nHost: vip\r\n\r\n", verdict: h1OK, netOK: true},
	{name: "chunked", raw: "POST / HTTP/1.1\r\nHost: vip\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n", verdict: h1OK, netOK: true},
	{name: "chunked-case", raw: "POST / HTTP/1.1\r\nHost: vip\r\nTransfer-Encoding: Chunked\r\n\r\n0\r\n\r\n", verdict: h1OK, netOK: true},
	{name: "expect-continue", raw: "POST / HTTP/1.1\r\nHost: vip\r\nExpect: 100-continue\r\nContent-Length: 2\r\n\r\n{}", verdict: h1OK, netOK: true},
	{name: "connection-close", raw: "GET / HTTP/1.1\r\nHost: vip\r\nConnection: keep-alive, close\r\n\r\n", verdict: h1OK, netOK: true},
	{name: "empty-host", raw: "GET / HTTP/1.1\r\nHost:\r\n\r\n", verdict: h1OK, netOK: true},

	// Smuggling shapes (RFC 9112 §6.1, §6.3).
	{name: "te-and-cl", raw: "POST / HTTP/1.1\r\nHost: vip\r\nContent-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n", verdict: h1Reject, reason: reasonFraming, netOK: true,
		note: "net/http drops Content-Length and reads chunked; RFC 9112 §6.1 lets a server reject, which the proxy does as HAProxy does"},
	{name: "cl-and-te", raw: "POST / HTTP/1.1\r\nHost: vip\r\nTransfer-Encoding: chunked\r\nContent-Length: 4\r\n\r\n0\r\n\r\n", verdict: h1Reject, reason: reasonFraming, netOK: true,
		note: "as te-and-cl"},
	{name: "cl-twice-same", raw: "POST / HTTP/1.1\r\nHost: vip\r\nContent-Length: 2\r\nContent-Length: 2\r\n\r\n{}", verdict: h1Reject, reason: reasonFraming, netOK: true,
		note: "net/http folds identical duplicates; the proxy refuses any second Content-Length"},
	{name: "cl-twice-differ", raw: "POST / HTTP/1.1\r\nHost: vip\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\n{}x", verdict: h1Reject, reason: reasonFraming},
	{name: "cl-list", raw: "POST / HTTP/1.1\r\nHost: vip\r\nContent-Length: 2, 2\r\n\r\n{}", verdict: h1Reject, reason: reasonFraming},
	{name: "cl-negative", raw: "POST / HTTP/1.1\r\nHost: vip\r\nContent-Length: -1\r\n\r\n", verdict: h1Reject, reason: reasonFraming},
	{name: "cl-plus", raw: "POST / HTTP/1.1\r\nHost: vip\r\nContent-Length: +2\r\n\r\n{}", verdict: h1Reject, reason: reasonFraming},
	{name: "cl-space-inside", raw: "POST / HTTP/1.1\r\nHost: vip\r\nContent-Length: 1 2\r\n\r\n{}", verdict: h1Reject, reason: reasonFraming},
	{name: "cl-hex", raw: "POST / HTTP/1.1\r\nHost: vip\r\nContent-Length: 0x2\r\n\r\n{}", verdict: h1Reject, reason: reasonFraming},
	{name: "cl-empty", raw: "POST / HTTP/1.1\r\nHost: vip\r\nContent-Length:\r\n\r\n", verdict: h1Reject, reason: reasonFraming},
	{name: "te-twice", raw: "POST / HTTP/1.1\r\nHost: vip\r\nTransfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n", verdict: h1Reject, reason: reasonUnsupportedTE},
	{name: "te-list", raw: "POST / HTTP/1.1\r\nHost: vip\r\nTransfer-Encoding: gzip, chunked\r\n\r\n0\r\n\r\n", verdict: h1Reject, reason: reasonUnsupportedTE},
	{name: "te-identity", raw: "POST / HTTP/1.1\r\nHost: vip\r\nTransfer-Encoding: identity\r\n\r\n", verdict: h1Reject, reason: reasonUnsupportedTE},
	{name: "te-xchunked", raw: "POST / HTTP/1.1\r\nHost: vip\r\nTransfer-Encoding: xchunked\r\n\r\n", verdict: h1Reject, reason: reasonUnsupportedTE},
	{name: "te-space-before-colon", raw: "POST / HTTP/1.1\r\nHost: vip\r\nTransfer-Encoding : chunked\r\nContent-Length: 2\r\n\r\n{}", verdict: h1Reject, reason: reasonBadRequest},
	{name: "obs-fold", raw: "GET / HTTP/1.1\r\nHost: vip\r\nX-A: a\r\n b\r\n\r\n", verdict: h1Reject, reason: reasonObsFold, netOK: true,
		note: "net/http joins folded lines; RFC 9112 §5.2 lets a server reject them, which the proxy does"},
	{name: "obs-fold-te", raw: "POST / HTTP/1.1\r\nHost: vip\r\nTransfer-Encoding:\r\n chunked\r\n\r\n0\r\n\r\n", verdict: h1Reject, reason: reasonObsFold, netOK: true,
		note: "as obs-fold"},
	{name: "first-line-fold", raw: "GET / HTTP/1.1\r\n Host: vip\r\n\r\n", verdict: h1Reject, reason: reasonObsFold},
	{name: "nul-in-value", raw: "GET / HTTP/1.1\r\nHost: vip\r\nX-A: a\x00b\r\n\r\n", verdict: h1Reject, reason: reasonBadRequest},
	{name: "del-in-value", raw: "GET / HTTP/1.1\r\nHost: vip\r\nX-A: a\x7fb\r\n\r\n", verdict: h1Reject, reason: reasonBadRequest},
	{name: "ctl-in-value", raw: "GET / HTTP/1.1\r\nHost: vip\r\nX-A: a\x0bb\r\n\r\n", verdict: h1Reject, reason: reasonBadRequest},
	{name: "bad-name-char", raw: "GET / HTTP/1.1\r\nHost: vip\r\nX@A: 1\r\n\r\n", verdict: h1Reject, reason: reasonBadRequest},
	{name: "empty-name", raw: "GET / HTTP/1.1\r\nHost: vip\r\n: 1\r\n\r\n", verdict: h1Reject, reason: reasonBadRequest},
	{name: "no-colon", raw: "GET / HTTP/1.1\r\nHost: vip\r\nFoo\r\n\r\n", verdict: h1Reject, reason: reasonBadRequest},
	{name: "no-host", raw: "GET / HTTP/1.1\r\nX-A: 1\r\n\r\n", verdict: h1Reject, reason: reasonBadRequest},
	{name: "two-hosts", raw: "GET / HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n", verdict: h1Reject, reason: reasonBadRequest},
	{name: "bad-host", raw: "GET / HTTP/1.1\r\nHost: a b\r\n\r\n", verdict: h1Reject, reason: reasonBadRequest},
	{name: "bad-method", raw: "G(T / HTTP/1.1\r\nHost: vip\r\n\r\n", verdict: h1Reject, reason: reasonBadRequest},
	{name: "no-target", raw: "GET HTTP/1.1\r\nHost: vip\r\n\r\n", verdict: h1Reject, reason: reasonBadRequest},

	// Left to net/http: no claim about its answer.
	{name: "bare-lf", raw: "GET / HTTP/1.1\nHost: vip\n\n", verdict: h1Fallback, reason: fallbackLineEnd},
	{name: "bare-lf-header", raw: "GET / HTTP/1.1\r\nHost: vip\nX-A: 1\r\n\r\n", verdict: h1Fallback, reason: fallbackLineEnd},
	{name: "bare-cr", raw: "GET / HTTP/1.1\r\nHost: vip\r\nX-A: a\rb\r\n\r\n", verdict: h1Fallback, reason: fallbackLineEnd},
	{name: "leading-crlf", raw: "\r\nGET / HTTP/1.1\r\nHost: vip\r\n\r\n", verdict: h1Fallback, reason: fallbackLineEnd},
	{name: "http10", raw: "GET / HTTP/1.0\r\n\r\n", verdict: h1Fallback, reason: fallbackVersion},
	{name: "http12", raw: "GET / HTTP/1.2\r\nHost: vip\r\n\r\n", verdict: h1Fallback, reason: fallbackVersion},
	{name: "version-trailing-space", raw: "GET / HTTP/1.1 \r\nHost: vip\r\n\r\n", verdict: h1Fallback, reason: fallbackVersion},
	{name: "double-space", raw: "GET  / HTTP/1.1\r\nHost: vip\r\n\r\n", verdict: h1Fallback, reason: fallbackVersion},
	{name: "absolute-form", raw: "GET http://vip/ HTTP/1.1\r\nHost: vip\r\n\r\n", verdict: h1Fallback, reason: fallbackTarget},
	{name: "connect", raw: "CONNECT vip:443 HTTP/1.1\r\nHost: vip:443\r\n\r\n", verdict: h1Fallback, reason: fallbackTarget},
	{name: "asterisk", raw: "OPTIONS * HTTP/1.1\r\nHost: vip\r\n\r\n", verdict: h1Fallback, reason: fallbackTarget},
	{name: "escaped-path", raw: "GET /a%2Fb HTTP/1.1\r\nHost: vip\r\n\r\n", verdict: h1Fallback, reason: fallbackTarget},
	{name: "quote-in-path", raw: "GET /a'b HTTP/1.1\r\nHost: vip\r\n\r\n", verdict: h1Fallback, reason: fallbackTarget},
	{name: "expect-other", raw: "POST / HTTP/1.1\r\nHost: vip\r\nExpect: 200-ok\r\nContent-Length: 2\r\n\r\n{}", verdict: h1Fallback, reason: fallbackExpect},
	{name: "h2-preface", raw: "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", verdict: h1Fallback, reason: fallbackVersion},
}

// leanParse runs the lean parser on a complete head.
func leanParse(raw []byte) (h1Verdict, h1Head) {
	var hd h1Head
	n := scanHead(raw)
	switch {
	case n < 0:
		return h1Fallback, h1Head{reason: fallbackLineEnd}
	case n == 0:
		return h1More, hd
	}
	return parseHead(raw[:n], &hd), hd
}

func TestH1ParseCorpus(t *testing.T) {
	for _, tc := range h1Corpus {
		v, hd := leanParse([]byte(tc.raw))
		if v != tc.verdict || tc.verdict != h1OK && hd.reason != tc.reason {
			t.Errorf("%s: verdict %d reason %q, want %d %q", tc.name, v, hd.reason, tc.verdict, tc.reason)
		}
	}
}

// netView is what net/http's server made of a request.
type netView struct {
	Method, Host, Path, RawQuery, RequestURI string
	Header                                   http.Header
	ContentLength                            int64
	Chunked, Close                           bool
	Body                                     string
}

// TestH1ParseMatchesNetHTTP sends every corpus request to a net/http
// server and checks the lean parser against it: what the lean parser
// accepts, net/http accepts with the same method, target, host, fields
// and framing; what it refuses, net/http refuses too, except for the
// noted shapes where the proxy is stricter on purpose.
func TestH1ParseMatchesNetHTTP(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		_ = json.NewEncoder(w).Encode(netView{
			Method: r.Method, Host: r.Host, Path: r.URL.Path, RawQuery: r.URL.RawQuery, RequestURI: r.RequestURI,
			Header: r.Header, ContentLength: r.ContentLength, Chunked: len(r.TransferEncoding) > 0,
			Close: r.Close, Body: string(body),
		})
	}))
	defer srv.Close()
	for _, tc := range h1Corpus {
		if tc.verdict == h1Fallback {
			continue
		}
		t.Run(tc.name, func(t *testing.T) {
			status, view := netHTTPAnswer(t, srv.Listener.Addr().String(), tc.raw)
			ok := status > 0 && status < 400
			if ok != tc.netOK {
				t.Fatalf("net/http answered %d; the corpus says it accepts: %v", status, tc.netOK)
			}
			v, hd := leanParse([]byte(tc.raw))
			if v != h1OK {
				return
			}
			want := view.Header
			want.Del("Expect")
			got := hd.header
			if got == nil {
				got = http.Header{}
			}
			if !reflect.DeepEqual(got, want) {
				t.Errorf("fields %v, net/http %v", got, want)
			}
			cl := hd.contentLength
			if hd.chunked {
				cl = -1
			}
			if hd.method != view.Method || hd.host != view.Host || hd.path != view.Path || hd.query != view.RawQuery ||
				hd.target != view.RequestURI || cl != view.ContentLength || hd.chunked != view.Chunked || hd.close != view.Close {
				t.Errorf("lean %q %q %q %q %q cl=%d chunked=%v close=%v, net/http %+v",
					hd.method, hd.host, hd.path, hd.query, hd.target, cl, hd.chunked, hd.close, view)
			}
		})
	}
}

// netHTTPAnswer sends raw to a net/http server and returns its status
// (0 if it closed without one) and, for a 200, what it parsed.
func netHTTPAnswer(t *testing.T, addr, raw string) (int, netView) {
	t.Helper()
	c, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(30 * time.Second)) // a hang guard, not a performance limit
	if _, err := io.WriteString(c, raw); err != nil {
		t.Fatal(err)
	}
	br := bufio.NewReader(c)
	resp, err := http.ReadResponse(br, nil)
	for err == nil && resp.StatusCode == http.StatusContinue {
		resp, err = http.ReadResponse(br, nil)
	}
	if err != nil {
		return 0, netView{}
	}
	defer resp.Body.Close()
	var v netView
	if resp.StatusCode == 200 {
		if err := json.NewDecoder(resp.Body).Decode(&v); err != nil {
			t.Fatalf("decode: %v", err)
		}
	}
	return resp.StatusCode, v
}

// FuzzH1Head checks the lean parser on arbitrary heads: it never panics,
// and whatever it accepts, net/http's request parser accepts with the
// same method, target, host and fields.
func FuzzH1Head(f *testing.F) {
	for _, tc := range h1Corpus {
		f.Add([]byte(tc.raw))
	}
	f.Fuzz(func(t *testing.T, raw []byte) {
		v, hd := leanParse(raw)
		if v != h1OK {
			return
		}
		n := scanHead(raw)
		if hd.n != n || n < 4 || !bytes.HasSuffix(raw[:n], []byte("\r\n\r\n")) {
			t.Fatalf("head length %d, scan %d", hd.n, n)
		}
		r, err := http.ReadRequest(bufio.NewReader(bytes.NewReader(raw[:n])))
		if err != nil {
			t.Fatalf("lean parser accepted what net/http refuses (%v): %q", err, raw[:n])
		}
		want := r.Header
		want.Del("Expect")
		got := hd.header
		if got == nil {
			got = http.Header{}
		}
		if !reflect.DeepEqual(got, want) {
			t.Fatalf("fields %v, net/http %v", got, want)
		}
		if hd.method != r.Method || hd.host != r.Host || hd.target != r.RequestURI || hd.path != r.URL.Path ||
			hd.query != r.URL.RawQuery || hd.close != r.Close {
			t.Fatalf("lean %q %q %q %q %q, net/http %q %q %q %q %q", hd.method, hd.host, hd.target, hd.path, hd.query,
				r.Method, r.Host, r.RequestURI, r.URL.Path, r.URL.RawQuery)
		}
		if !hd.chunked && hd.contentLength != r.ContentLength || hd.chunked != (len(r.TransferEncoding) > 0) {
			t.Fatalf("framing: lean cl=%d chunked=%v, net/http cl=%d te=%v", hd.contentLength, hd.chunked, r.ContentLength, r.TransferEncoding)
		}
		for k := range hd.header {
			if http.CanonicalHeaderKey(k) != k || strings.ContainsAny(k, " \t:") {
				t.Fatalf("field name %q not canonical", k)
			}
		}
	})
}

// FuzzH1ChunkedBody checks the lean chunked body reader: it never panics,
// never reads past the body's end, and whatever body it accepts,
// net/http's chunked reader decodes to the same bytes.
func FuzzH1ChunkedBody(f *testing.F) {
	f.Add([]byte("3\r\nabc\r\n0\r\n\r\n"))
	f.Add([]byte("3;ext=1\r\nabc\r\n2\r\nde\r\n0\r\nX-T: 1\r\n\r\nNEXT"))
	f.Add([]byte("a\r\n0123456789\r\n0\r\n\r\n"))
	f.Add([]byte("3\nabc\n0\n\n"))
	f.Fuzz(func(t *testing.T, raw []byte) {
		c := &h1Conn{br: bufio.NewReaderSize(bytes.NewReader(raw), h1BufSize)}
		var b h1Body
		b.reset(c, &h1Head{chunked: true, contentLength: -1})
		got, err := io.ReadAll(io.LimitReader(&b, 1<<20))
		if err != nil || !b.done {
			return
		}
		want, err := io.ReadAll(httputil.NewChunkedReader(bytes.NewReader(raw)))
		if err != nil || !bytes.Equal(got, want) {
			t.Fatalf("lean body %q, net/http %q (%v)", got, want, err)
		}
	})
}
