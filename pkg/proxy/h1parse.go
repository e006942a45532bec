package proxy

import (
	"bytes"
	"net/http"
	"unsafe"

	"golang.org/x/net/http/httpguts"
)

// h1Verdict is what the lean HTTP/1.1 parser makes of a request head.
type h1Verdict uint8

const (
	// h1OK: a plain HTTP/1.1 request the lean path serves.
	h1OK h1Verdict = iota
	// h1More: the head is not complete yet.
	h1More
	// h1Fallback: a form the lean path does not serve (valid or not):
	// net/http's server gets the connection and decides.
	h1Fallback
	// h1Reject: a head the proxy refuses itself (framing that could
	// smuggle a second request, obs-fold, bad syntax).
	h1Reject
)

// h1Head is one parsed request head. Its strings point into one private
// copy of the head's bytes (one allocation per request), never into the
// connection's read buffer, so they stay valid for as long as anyone holds
// them.
type h1Head struct {
	method, target, path, query, host string
	header                            http.Header
	contentLength                     int64 // -1: chunked
	chunked, close, expectContinue    bool
	n                                 int // bytes of the head, with its empty line
	// reason names the rejection or fallback, for metrics and the 400.
	reason string
	status int // of a rejection
}

// Rejection and fallback reasons (labels of loxilb_proxy_conn_rejected_total
// and loxilb_proxy_http1_fallback_total).
const (
	reasonBadRequest    = "bad_request"    // request line or header syntax
	reasonFraming       = "framing"        // Content-Length / Transfer-Encoding shapes that could smuggle
	reasonObsFold       = "obs_fold"       // a header line continued on the next (RFC 9112 §5.2)
	reasonUnsupportedTE = "unsupported_te" // a transfer coding other than chunked (501)
	fallbackVersion     = "version"        // not HTTP/1.1 (HTTP/1.0, HTTP/2 preface, ...)
	fallbackTarget      = "target"         // absolute-form, authority-form (CONNECT), asterisk-form, escapes
	fallbackLineEnd     = "line_end"       // a bare LF or CR: net/http's own rules apply
	fallbackExpect      = "expect"         // an expectation other than 100-continue
	fallbackHeadSize    = "head_size"      // a head larger than the connection's read buffer
	fallbackProtocol    = "protocol"       // TLS negotiated something other than HTTP/1.1
	maxLeanHeaderFields = 256              // more fields: fallback (net/http's own limits)
	fallbackFields      = "header_fields"
)

// scanHead finds the end of the head in b. It returns the head's length
// (with its empty line), 0 if the head is not complete, or -1 if b holds a
// line ending the lean parser leaves to net/http (a bare LF or CR).
func scanHead(b []byte) int {
	i := 0
	for {
		j := bytes.IndexByte(b[i:], '\n')
		if j < 0 {
			if bytes.IndexByte(b[i:], '\r') >= 0 && bytes.IndexByte(b[i:], '\r') < len(b[i:])-1 {
				return -1 // a CR not followed by LF
			}
			return 0
		}
		j += i
		if j == 0 || b[j-1] != '\r' || bytes.IndexByte(b[i:j-1], '\r') >= 0 {
			return -1
		}
		if j-1 == i { // an empty line
			if i == 0 {
				return -1 // a leading empty line: net/http decides
			}
			return j + 1
		}
		i = j + 1
	}
}

// parseHead parses the complete head src (as scanHead delimited it) into
// hd. It allocates the copy the strings point into, the header map and
// one array for all its values.
func parseHead(src []byte, hd *h1Head) h1Verdict {
	*hd = h1Head{n: len(src)}
	// Request line: method SP request-target SP HTTP-version CRLF.
	eol := bytes.IndexByte(src, '\r')
	line := src[:eol]
	sp1 := bytes.IndexByte(line, ' ')
	if sp1 <= 0 {
		return hd.reject(reasonBadRequest, http.StatusBadRequest)
	}
	sp2 := bytes.IndexByte(line[sp1+1:], ' ')
	if sp2 < 0 {
		return hd.reject(reasonBadRequest, http.StatusBadRequest)
	}
	sp2 += sp1 + 1
	method, target, version := line[:sp1], line[sp1+1:sp2], line[sp2+1:]
	for _, c := range method {
		if !isTokenByte(c) {
			return hd.reject(reasonBadRequest, http.StatusBadRequest)
		}
	}
	if string(version) != "HTTP/1.1" {
		return hd.fallback(fallbackVersion)
	}
	q := -1
	if len(target) == 0 || target[0] != '/' {
		return hd.fallback(fallbackTarget)
	}
	for i, c := range target {
		if q < 0 {
			if c == '?' {
				q = i
				continue
			}
			if !pathByte(c) {
				return hd.fallback(fallbackTarget)
			}
		} else if c <= ' ' || c >= 0x7f {
			return hd.fallback(fallbackTarget)
		}
	}

	// Count the fields first: the values share one array.
	fields := bytes.Count(src[eol+2:], []byte("\r\n")) - 1
	if fields > maxLeanHeaderFields {
		return hd.fallback(fallbackFields)
	}
	// The one copy every string of the request points into; header names
	// are canonicalised in it.
	buf := make([]byte, len(src))
	copy(buf, src)
	str := func(b []byte) string {
		if len(b) == 0 {
			return ""
		}
		return unsafe.String(&b[0], len(b))
	}
	hd.method = str(buf[:sp1])
	hd.target = str(buf[sp1+1 : sp2])
	if q >= 0 {
		hd.path, hd.query = str(buf[sp1+1:sp1+1+q]), str(buf[sp1+2+q:sp2])
	} else {
		hd.path = hd.target
	}
	if fields > 0 {
		hd.header = make(http.Header, fields)
	}
	vals := make([]string, fields)
	nv := 0
	hosts, cls, tes := 0, 0, 0
	hd.contentLength = 0
	var te string
	off := eol + 2
	for off < len(buf)-2 {
		end := off + bytes.IndexByte(buf[off:], '\r')
		l := buf[off:end]
		off = end + 2
		if l[0] == ' ' || l[0] == '\t' {
			return hd.reject(reasonObsFold, http.StatusBadRequest)
		}
		colon := bytes.IndexByte(l, ':')
		if colon <= 0 {
			return hd.reject(reasonBadRequest, http.StatusBadRequest)
		}
		name := l[:colon]
		upper := true
		for i, c := range name {
			if !isTokenByte(c) {
				return hd.reject(reasonBadRequest, http.StatusBadRequest)
			}
			// textproto.CanonicalMIMEHeaderKey, in place.
			if upper && 'a' <= c && c <= 'z' {
				name[i] = c - 'a' + 'A'
			} else if !upper && 'A' <= c && c <= 'Z' {
				name[i] = c - 'A' + 'a'
			}
			upper = c == '-'
		}
		v := l[colon+1:]
		for len(v) > 0 && (v[0] == ' ' || v[0] == '\t') {
			v = v[1:]
		}
		for len(v) > 0 && (v[len(v)-1] == ' ' || v[len(v)-1] == '\t') {
			v = v[:len(v)-1]
		}
		for _, c := range v {
			if c < ' ' && c != '\t' || c == 0x7f {
				return hd.reject(reasonBadRequest, http.StatusBadRequest)
			}
		}
		k, val := str(name), str(v)
		switch k {
		case "Host":
			hosts++
			hd.host = val
			continue // net/http keeps Host out of the map too
		case "Content-Length":
			cls++
			n, ok := parseDecimal(v)
			if !ok || cls > 1 {
				return hd.reject(reasonFraming, http.StatusBadRequest)
			}
			hd.contentLength = n
		case "Transfer-Encoding":
			tes++
			te = val
			continue // net/http keeps it out of the map too
		case "Connection":
			if !hd.close && httpguts.HeaderValuesContainsToken([]string{val}, "close") {
				hd.close = true
			}
		case "Expect":
			if !asciiEqualFold(val, "100-continue") {
				return hd.fallback(fallbackExpect)
			}
			hd.expectContinue = true
			continue // answered here, never relayed
		}
		vals[nv] = val
		if vv, ok := hd.header[k]; ok {
			hd.header[k] = append(vv, val)
		} else {
			hd.header[k] = vals[nv : nv+1 : nv+1]
		}
		nv++
	}
	switch {
	case hosts != 1:
		return hd.reject(reasonBadRequest, http.StatusBadRequest)
	case !httpguts.ValidHostHeader(hd.host):
		return hd.reject(reasonBadRequest, http.StatusBadRequest)
	case tes > 0 && cls > 0:
		return hd.reject(reasonFraming, http.StatusBadRequest)
	case tes > 1:
		return hd.reject(reasonUnsupportedTE, http.StatusNotImplemented)
	case tes == 1:
		if !asciiEqualFold(te, "chunked") {
			return hd.reject(reasonUnsupportedTE, http.StatusNotImplemented)
		}
		hd.chunked, hd.contentLength = true, -1
	}
	if hd.contentLength == 0 {
		hd.expectContinue = false // nothing to wait for
	}
	return h1OK
}

func (hd *h1Head) reject(reason string, status int) h1Verdict {
	hd.reason, hd.status = reason, status
	return h1Reject
}

func (hd *h1Head) fallback(reason string) h1Verdict {
	hd.reason = reason
	return h1Fallback
}

// pathByte reports whether c may appear in a path the lean parser takes
// as it is: the bytes url.URL.EscapedPath writes unchanged. Any other
// byte (a percent escape, a quote, a non-ASCII byte) leaves the target to
// net/http's URL parser.
func pathByte(c byte) bool {
	switch {
	case 'a' <= c && c <= 'z', 'A' <= c && c <= 'Z', '0' <= c && c <= '9':
		return true
	}
	switch c {
	case '-', '_', '.', '~', '$', '&', '+', ',', '/', ':', ';', '=', '@':
		return true
	}
	return false
}

// parseDecimal parses a Content-Length value: 1 to 18 digits, nothing
// else (no sign, no list, no spaces inside).
func parseDecimal(b []byte) (int64, bool) {
	if len(b) == 0 || len(b) > 18 {
		return 0, false
	}
	var n int64
	for _, c := range b {
		if c < '0' || c > '9' {
			return 0, false
		}
		n = n*10 + int64(c-'0')
	}
	return n, true
}

func asciiEqualFold(s, t string) bool {
	if len(s) != len(t) {
		return false
	}
	for i := 0; i < len(s); i++ {
		a, b := s[i], t[i]
		if 'A' <= a && a <= 'Z' {
			a += 'a' - 'A'
		}
		if 'A' <= b && b <= 'Z' {
			b += 'a' - 'A'
		}
		if a != b {
			return false
		}
	}
	return true
}
