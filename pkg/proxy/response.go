package proxy

import (
	"bufio"
	"bytes"
	"io"
	"net/http"
)

// upResponse is an endpoint's response with everything the relay needs in
// one allocation: the http.Response, its body reader, the fixed-length
// reader under it and the value slices of its header.
type upResponse struct {
	resp  http.Response
	body  bodyReader
	fixed fixedBody
	vals  [fastMaxFields]string
}

// fastMaxFields bounds the header fields the fast path takes; a response
// with more goes to net/http's parser.
const fastMaxFields = 16

// readResponseFast parses the response head waiting in br when it is of
// the plain form nearly every engine sends: a complete head already
// buffered, "HTTP/1.1 NNN reason", a final status other than 204 and 304,
// fields of token names and printable ASCII values on CRLF lines, one
// Content-Length, no Transfer-Encoding, Connection, Trailer or Pragma,
// to a request other than HEAD. For such a head net/http's rules reduce
// to what is done here (FuzzFastResponse holds it to http.ReadResponse),
// at three allocations instead of about ten. For anything else it
// consumes nothing and returns nil, and the caller uses http.ReadResponse:
// the edge cases keep the standard library's handling.
func readResponseFast(br *bufio.Reader, req *http.Request) *upResponse {
	if req != nil && req.Method == http.MethodHead {
		return nil
	}
	buf, _ := br.Peek(br.Buffered())
	end := bytes.Index(buf, []byte("\r\n\r\n"))
	if end < 0 {
		return nil
	}
	head := buf[:end+2] // every line with its CRLF
	line, rest, _ := bytes.Cut(head, []byte("\r\n"))
	// "HTTP/1.1 200" and an optional " reason".
	if len(line) < 12 || string(line[:9]) != "HTTP/1.1 " || len(line) > 12 && line[12] != ' ' {
		return nil
	}
	code := 0
	for _, c := range line[9:12] {
		if c < '0' || c > '9' {
			return nil
		}
		code = code*10 + int(c-'0')
	}
	if code < 200 || code == http.StatusNoContent || code == http.StatusNotModified {
		return nil
	}
	for _, c := range line[12:] {
		if !printable(c) {
			return nil
		}
	}

	// One string holds the status and every key and value; the header
	// map's strings are slices of it.
	s := string(head[9:])
	off := 9 // head offset of s[0]
	ur := &upResponse{}
	r := &ur.resp
	r.Status = s[:len(line)-9]
	r.StatusCode = code
	r.Proto, r.ProtoMajor, r.ProtoMinor = "HTTP/1.1", 1, 1
	r.Request = req
	r.Header = make(http.Header, bytes.Count(rest, []byte("\r\n")))
	n, clen := 0, int64(-1)
	for len(rest) > 0 {
		var fl []byte
		fl, rest, _ = bytes.Cut(rest, []byte("\r\n"))
		start := len(head) - len(rest) - len(fl) - 2 - off // fl's offset in s
		colon := bytes.IndexByte(fl, ':')
		if colon <= 0 || n == fastMaxFields {
			return nil
		}
		key, ok := canonicalKey(fl[:colon], s[start:start+colon])
		if !ok {
			return nil
		}
		v := fl[colon+1:]
		vs := start + colon + 1
		for _, c := range v {
			if !printable(c) {
				return nil
			}
		}
		for len(v) > 0 && (v[0] == ' ' || v[0] == '\t') {
			v, vs = v[1:], vs+1
		}
		for len(v) > 0 && (v[len(v)-1] == ' ' || v[len(v)-1] == '\t') {
			v = v[:len(v)-1]
		}
		switch key {
		case "Transfer-Encoding", "Connection", "Trailer", "Pragma":
			return nil
		case "Content-Length":
			if clen >= 0 || len(v) == 0 || len(v) > 18 {
				return nil
			}
			clen = 0
			for _, c := range v {
				if c < '0' || c > '9' {
					return nil
				}
				clen = clen*10 + int64(c-'0')
			}
		}
		if _, dup := r.Header[key]; dup {
			return nil
		}
		ur.vals[n] = s[vs : vs+len(v)]
		r.Header[key] = ur.vals[n : n+1 : n+1]
		n++
	}
	if clen < 0 {
		return nil
	}
	r.ContentLength = clen
	if clen == 0 {
		r.Body = http.NoBody
	} else {
		ur.fixed = fixedBody{r: br, left: clen}
		r.Body = &ur.fixed
	}
	_, _ = br.Discard(end + 4)
	return ur
}

// printable reports whether c may appear in a status reason or a field
// value on the fast path: visible ASCII, space and tab.
func printable(c byte) bool { return c == '\t' || ' ' <= c && c < 0x7f }

// canonicalKey returns the canonical form of the field name b (given also
// as s, the same bytes as a string): s itself when it already is
// canonical, as engines send them, otherwise a new string. It reports
// false for a name that is not a token.
func canonicalKey(b []byte, s string) (string, bool) {
	canonical, upper := true, true
	for _, c := range b {
		if !isTokenByte(c) {
			return "", false
		}
		switch {
		case upper && 'a' <= c && c <= 'z', !upper && 'A' <= c && c <= 'Z':
			canonical = false
		}
		upper = c == '-'
	}
	if canonical {
		return s, true
	}
	return http.CanonicalHeaderKey(s), true
}

// isTokenByte reports whether c is a tchar (RFC 9110 §5.6.2).
func isTokenByte(c byte) bool {
	switch {
	case 'a' <= c && c <= 'z', 'A' <= c && c <= 'Z', '0' <= c && c <= '9':
		return true
	}
	switch c {
	case '!', '#', '$', '%', '&', '\'', '*', '+', '-', '.', '^', '_', '`', '|', '~':
		return true
	}
	return false
}

// fixedBody reads a Content-Length body: io.EOF with its last byte (so
// the connection goes back to the pool without another read), and
// io.ErrUnexpectedEOF if the endpoint closes early, as net/http's body
// reader does.
type fixedBody struct {
	r    io.Reader
	left int64
}

func (b *fixedBody) Read(p []byte) (int, error) {
	if b.left <= 0 {
		return 0, io.EOF
	}
	if int64(len(p)) > b.left {
		p = p[:b.left]
	}
	n, err := b.r.Read(p)
	b.left -= int64(n)
	switch {
	case b.left == 0:
		return n, io.EOF
	case err == io.EOF:
		return n, io.ErrUnexpectedEOF
	}
	return n, err
}

func (b *fixedBody) Close() error { return nil }
