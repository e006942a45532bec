package proxy

import (
	"bufio"
	"net"
	"net/http"
	"net/url"
	"slices"
	"strconv"
	"strings"

	"golang.org/x/net/http/httpguts"
)

// wireRequest writes a client's request to an endpoint as HTTP/1.1, the
// bytes http.Request.Write would send for the same request, without
// building an http.Request, a header map or a body reader for it: for a
// small request those were a fifth of the proxy's allocations.
//
// What goes out: the client's method, path and query; its Host (the
// endpoint's address for a client that sent none); its header fields
// merged with the endpoint's (Endpoint.Header wins), minus hop-by-hop
// fields and the ones the Connection field names (RFC 9110 §7.6.1), the
// receipt request and Expect (the body is already here); Te only as
// "trailers"; User-Agent only if the client sent one; X-Forwarded-For with
// the client's address appended and X-Forwarded-Proto; Content-Length of
// the buffered body. Field values have CR and LF replaced by spaces, as
// net/http does.
type wireRequest struct {
	r     *http.Request
	ep    Endpoint
	body  []byte
	https bool     // the client connection was TLS
	num   [20]byte // scratch for Content-Length
}

// field is one header field that goes out unchanged.
type field struct {
	k  string
	vv []string
}

// outboundFields counts the fields a request usually carries; more still
// work, the array just stops being enough.
const outboundFields = 32

// dropped reports whether the merged field k is not relayed as it is.
func (w *wireRequest) dropped(k string) bool {
	switch k {
	case "Connection", "Proxy-Connection", "Keep-Alive", "Proxy-Authenticate",
		"Proxy-Authorization", "Te", "Trailer", "Transfer-Encoding", "Upgrade",
		HeaderReceiptRequest, "Expect", "Host", "User-Agent", "Content-Length",
		"X-Forwarded-For", "X-Forwarded-Proto":
		return true
	}
	return w.connectionNames(k) || !httpguts.ValidHeaderFieldName(k)
}

// connectionNames reports whether the merged Connection field names k.
func (w *wireRequest) connectionNames(k string) bool {
	for _, v := range w.lookup("Connection") {
		for v != "" {
			var tok string
			tok, v, _ = strings.Cut(v, ",")
			if strings.EqualFold(strings.TrimSpace(tok), k) {
				return true
			}
		}
	}
	return false
}

// lookup returns the merged values of the canonical key k.
func (w *wireRequest) lookup(k string) []string {
	for ek, vv := range w.ep.Header {
		if http.CanonicalHeaderKey(ek) == k {
			return vv
		}
	}
	return w.r.Header[k]
}

// get is lookup for a field that Connection may have removed.
func (w *wireRequest) get(k string) []string {
	if w.connectionNames(k) {
		return nil
	}
	return w.lookup(k)
}

// writeRequest writes the request line, the header block and the body.
func (w *wireRequest) writeRequest(bw *bufio.Writer) error {
	r := w.r
	host := r.Host
	if host == "" {
		host = w.ep.Addr
	}
	host, err := httpguts.PunycodeHostPort(host)
	if err != nil {
		return err
	}
	if !httpguts.ValidHostHeader(host) {
		// Never relay a Host that could smuggle: send it empty, as
		// net/http does (the server in front rejects these anyway).
		host = ""
	}
	host = removeZone(host)
	method := r.Method
	if method == "" {
		method = http.MethodGet
	}
	bw.WriteString(method)
	bw.WriteByte(' ')
	writeRequestURI(bw, r.URL)
	bw.WriteString(" HTTP/1.1\r\nHost: ")
	bw.WriteString(host)
	bw.WriteString("\r\n")
	if ua := w.get("User-Agent"); len(ua) > 0 && ua[0] != "" {
		writeField(bw, "User-Agent", ua[0])
	}
	// net/http declares an empty body only for the methods servers
	// expect one with.
	if n := len(w.body); n > 0 || method == http.MethodPost || method == http.MethodPut || method == http.MethodPatch {
		bw.WriteString("Content-Length: ")
		bw.Write(strconv.AppendInt(w.num[:0], int64(n), 10))
		bw.WriteString("\r\n")
	}

	var arr [outboundFields]field
	fs := arr[:0]
	for k, vv := range r.Header {
		if w.overridden(k) || w.dropped(k) {
			continue
		}
		fs = append(fs, field{k, vv})
	}
	for k, vv := range w.ep.Header {
		if k = http.CanonicalHeaderKey(k); !w.dropped(k) {
			fs = append(fs, field{k, vv})
		}
	}
	slices.SortFunc(fs, func(a, b field) int { return strings.Compare(a.k, b.k) })
	for _, f := range fs {
		for _, v := range f.vv {
			writeField(bw, f.k, v)
		}
	}

	if te := r.Header["Te"]; len(te) > 0 && te[0] == "trailers" {
		bw.WriteString("Te: trailers\r\n")
	}
	if ip, _, err := net.SplitHostPort(r.RemoteAddr); err == nil {
		bw.WriteString("X-Forwarded-For: ")
		for _, p := range w.get("X-Forwarded-For") {
			writeValue(bw, p)
			bw.WriteString(", ")
		}
		writeValue(bw, ip)
		bw.WriteString("\r\n")
	} else {
		for _, v := range w.get("X-Forwarded-For") {
			writeField(bw, "X-Forwarded-For", v)
		}
	}
	if w.https {
		bw.WriteString("X-Forwarded-Proto: https\r\n\r\n")
	} else {
		bw.WriteString("X-Forwarded-Proto: http\r\n\r\n")
	}
	_, err = bw.Write(w.body)
	return err
}

// overridden reports whether the endpoint's header replaces the client's
// field k.
func (w *wireRequest) overridden(k string) bool {
	for ek := range w.ep.Header {
		if http.CanonicalHeaderKey(ek) == k {
			return true
		}
	}
	return false
}

// writeRequestURI writes the origin-form target, as URL.RequestURI
// (an empty query is dropped with its "?").
func writeRequestURI(bw *bufio.Writer, u *url.URL) {
	p := u.EscapedPath()
	if p == "" {
		p = "/"
	}
	bw.WriteString(p)
	if u.RawQuery != "" {
		bw.WriteByte('?')
		bw.WriteString(u.RawQuery)
	}
}

func writeField(bw *bufio.Writer, k, v string) {
	bw.WriteString(k)
	bw.WriteString(": ")
	writeValue(bw, v)
	bw.WriteString("\r\n")
}

// writeValue writes v trimmed, with CR and LF as spaces: a value must not
// end the field early (net/http's Header.Write does the same).
func writeValue(bw *bufio.Writer, v string) {
	v = strings.Trim(v, " \t\r\n")
	for {
		i := strings.IndexAny(v, "\r\n")
		if i < 0 {
			bw.WriteString(v)
			return
		}
		bw.WriteString(v[:i])
		bw.WriteByte(' ')
		v = v[i+1:]
	}
}

// removeZone drops an IPv6 zone from a Host value ("[fe80::1%en0]:80"),
// which means nothing to the endpoint; net/http's request writer does
// the same.
func removeZone(host string) string {
	if !strings.HasPrefix(host, "[") {
		return host
	}
	i := strings.LastIndex(host, "]")
	if i < 0 {
		return host
	}
	j := strings.LastIndex(host[:i], "%")
	if j < 0 {
		return host
	}
	return host[:j] + host[i:]
}

// rewind is a no-op: the body is a buffer, written again as it is.
func (w *wireRequest) rewind() error { return nil }
