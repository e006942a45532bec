package proxy

import (
	"net/http"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"time"
)

// h1PendMax is how much body a response without a declared length may
// hold before its head goes out chunked; a handler that ends within it
// gets a Content-Length instead (net/http's rule, with its buffer size).
const h1PendMax = 2048

// h1Writer is the lean server's http.ResponseWriter: it writes the status
// line, the header block and the body straight into the connection's
// buffered writer. The proxy's relay hands it the endpoint's header map
// (commit), which is written filtered, without copying it into a map of
// its own. It also implements http.Flusher and the deadline methods
// http.ResponseController looks for. One lives in each h1Conn.
type h1Writer struct {
	c *h1Conn

	hdr   http.Header // the handler's own fields, made on first Header()
	upHdr http.Header // the endpoint's fields, relayed minus hop-by-hop ones

	head        bool // the request was HEAD
	status      int
	wroteHeader bool
	headSent    bool
	noBody      bool
	chunked     bool
	cl          int64 // declared Content-Length, -1 if none
	written     int64
	pend        []byte
	num         [24]byte
}

func (w *h1Writer) reset(c *h1Conn, head bool) {
	hdr, pend := w.hdr, w.pend
	*w = h1Writer{c: c, head: head, cl: -1, pend: pend[:0]}
	if len(hdr) > 0 {
		clear(hdr)
	}
	w.hdr = hdr
}

func (w *h1Writer) Header() http.Header {
	if w.hdr == nil {
		w.hdr = make(http.Header)
	}
	return w.hdr
}

// get returns the first value of the canonical key k, the endpoint's
// first.
func (w *h1Writer) get(k string) string {
	if vv := w.upHdr[k]; len(vv) > 0 {
		return vv[0]
	}
	if vv := w.hdr[k]; len(vv) > 0 {
		return vv[0]
	}
	return ""
}

func bodyAllowed(status int) bool {
	return status >= 200 && status != http.StatusNoContent && status != http.StatusNotModified
}

func (w *h1Writer) WriteHeader(code int) {
	if w.wroteHeader || code < 200 && code != http.StatusSwitchingProtocols {
		return // interim responses are not relayed; only the first final status counts
	}
	w.wroteHeader, w.status = true, code
	w.noBody = w.head || !bodyAllowed(code)
	if v := w.get("Content-Length"); v != "" {
		if n, ok := parseDecimal([]byte(v)); ok {
			w.cl = n
		}
	}
}

func (w *h1Writer) Write(p []byte) (int, error) {
	if !w.wroteHeader {
		w.WriteHeader(http.StatusOK)
	}
	if w.noBody {
		if !bodyAllowed(w.status) {
			return 0, http.ErrBodyNotAllowed
		}
		return len(p), nil // HEAD: the body is not sent
	}
	bw := w.c.bw
	if !w.headSent {
		if w.cl >= 0 {
			w.sendHead(false, -1)
		} else if len(w.pend)+len(p) <= h1PendMax {
			w.pend = append(w.pend, p...)
			return len(p), nil
		} else {
			w.sendHead(true, -1)
			w.writeChunk(w.pend)
			w.pend = w.pend[:0]
		}
	}
	if w.chunked {
		w.writeChunk(p)
	} else {
		if w.written+int64(len(p)) > w.cl {
			return 0, http.ErrContentLength
		}
		bw.Write(p)
		w.written += int64(len(p))
	}
	return len(p), w.c.writeErr()
}

func (w *h1Writer) writeChunk(p []byte) {
	if len(p) == 0 {
		return
	}
	bw := w.c.bw
	bw.Write(strconv.AppendUint(w.num[:0], uint64(len(p)), 16))
	bw.WriteString("\r\n")
	bw.Write(p)
	bw.WriteString("\r\n")
	w.written += int64(len(p))
}

// Flush sends the head (chunked if no length was declared) and whatever
// is buffered.
func (w *h1Writer) Flush() {
	if !w.wroteHeader {
		w.WriteHeader(http.StatusOK)
	}
	if !w.headSent {
		if w.noBody || w.cl >= 0 {
			w.sendHead(false, -1)
		} else {
			w.sendHead(true, -1)
			w.writeChunk(w.pend)
			w.pend = w.pend[:0]
		}
	}
	_ = w.c.bw.Flush()
}

// SetReadDeadline and SetWriteDeadline serve http.ResponseController.
func (w *h1Writer) SetReadDeadline(t time.Time) error  { return w.c.setReadDeadline(t) }
func (w *h1Writer) SetWriteDeadline(t time.Time) error { return w.c.rwc.SetWriteDeadline(t) }

// finish ends the response after the handler returned: a head not sent
// yet goes out with the length of what the handler wrote, a chunked body
// gets its last chunk and trailers. It does not flush.
func (w *h1Writer) finish() {
	if !w.wroteHeader {
		w.WriteHeader(http.StatusOK)
	}
	bw := w.c.bw
	if !w.headSent {
		cl := int64(-1)
		if !w.noBody && w.cl < 0 {
			cl = int64(len(w.pend))
		}
		w.sendHead(false, cl)
		if !w.noBody {
			bw.Write(w.pend)
			w.written += int64(len(w.pend))
		}
		w.pend = w.pend[:0]
	}
	switch {
	case w.chunked:
		bw.WriteString("0\r\n")
		for k, vv := range w.hdr {
			if name, ok := strings.CutPrefix(k, http.TrailerPrefix); ok && validFieldName(name) {
				for _, v := range vv {
					writeField(bw, name, v)
				}
			}
		}
		bw.WriteString("\r\n")
	case !w.noBody && w.cl >= 0 && w.written < w.cl:
		// The body is shorter than declared: the client would wait for
		// the rest; only closing tells it.
		w.c.closing = true
	}
}

func validFieldName(k string) bool {
	if k == "" {
		return false
	}
	for i := 0; i < len(k); i++ {
		if !isTokenByte(k[i]) {
			return false
		}
	}
	return true
}

// sendHead writes the status line and the header block. chunked selects
// the chunked body framing; cl >= 0 adds a Content-Length the fields do
// not carry.
func (w *h1Writer) sendHead(chunked bool, cl int64) {
	w.headSent = true
	c, bw := w.c, w.c.bw
	if !c.closing && (c.hd.close || c.s.dr.draining.Load() || !c.body.done ||
		headerHasToken(w.hdr["Connection"], "close")) {
		c.closing = true
	}
	bw.WriteString("HTTP/1.1 ")
	bw.Write(strconv.AppendInt(w.num[:0], int64(w.status), 10))
	bw.WriteByte(' ')
	if t := http.StatusText(w.status); t != "" {
		bw.WriteString(t)
	} else {
		bw.WriteString("status code ")
		bw.Write(strconv.AppendInt(w.num[:0], int64(w.status), 10))
	}
	bw.WriteString("\r\n")

	bodyOK := bodyAllowed(w.status)
	var arr [outboundFields]field
	fs := arr[:0]
	hasDate, hasCL, hasConn := false, false, false
	keep := func(k string) bool {
		switch k {
		case "Transfer-Encoding":
			return false
		case "Content-Length", "Content-Type":
			if !bodyOK {
				return false
			}
		}
		return !strings.HasPrefix(k, http.TrailerPrefix) && validFieldName(k)
	}
	for k, vv := range w.upHdr {
		if upstreamHop(w.upHdr, k) || !keep(k) {
			continue
		}
		fs = append(fs, field{k, vv})
	}
	for k, vv := range w.hdr {
		if _, dup := w.upHdr[k]; dup && !upstreamHop(w.upHdr, k) || !keep(k) {
			continue
		}
		fs = append(fs, field{k, vv})
	}
	slices.SortFunc(fs, func(a, b field) int { return strings.Compare(a.k, b.k) })
	for _, f := range fs {
		switch f.k {
		case "Date":
			hasDate = true
		case "Content-Length":
			hasCL = true
		case "Connection":
			hasConn = true
		}
		for _, v := range f.vv {
			writeField(bw, f.k, v)
		}
	}
	if !hasDate {
		bw.Write(httpDate())
	}
	switch {
	case chunked && !w.noBody:
		w.chunked = true
		bw.WriteString("Transfer-Encoding: chunked\r\n")
	case cl >= 0 && !hasCL && bodyOK && !(w.head && cl == 0):
		bw.WriteString("Content-Length: ")
		bw.Write(strconv.AppendInt(w.num[:0], cl, 10))
		bw.WriteString("\r\n")
	}
	if c.closing && !hasConn {
		bw.WriteString("Connection: close\r\n")
	}
	bw.WriteString("\r\n")
}

// upstreamHop reports whether the endpoint's field k stays on the
// endpoint's connection (RFC 9110 §7.6.1), or is the routing receipt,
// which only the proxy gives.
func upstreamHop(h http.Header, k string) bool {
	switch k {
	case "Connection", "Proxy-Connection", "Keep-Alive", "Proxy-Authenticate",
		"Proxy-Authorization", "Te", "Trailer", "Transfer-Encoding", "Upgrade", HeaderRoute:
		return true
	}
	return headerHasToken(h["Connection"], k) || IsRouteHeader(k)
}

// headerHasToken reports whether the comma-separated values vv name tok
// (case-insensitively).
func headerHasToken(vv []string, tok string) bool {
	for _, v := range vv {
		for v != "" {
			var t string
			t, v, _ = strings.Cut(v, ",")
			if asciiEqualFold(strings.TrimSpace(t), tok) {
				return true
			}
		}
	}
	return false
}

// dateLine caches the "Date: ...\r\n" field for the current second.
var dateLine struct {
	sec atomic.Int64
	v   atomic.Pointer[[]byte]
}

func httpDate() []byte {
	now := time.Now()
	if p := dateLine.v.Load(); p != nil && dateLine.sec.Load() == now.Unix() {
		return *p
	}
	b := append([]byte("Date: "), now.UTC().AppendFormat(make([]byte, 0, 40), http.TimeFormat)...)
	b = append(b, "\r\n"...)
	dateLine.v.Store(&b)
	dateLine.sec.Store(now.Unix())
	return b
}

var _ http.Flusher = (*h1Writer)(nil)
