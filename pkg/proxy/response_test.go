package proxy

import (
	"bufio"
	"bytes"
	"io"
	"net/http"
	"reflect"
	"strings"
	"testing"
)

// fastResponseSeeds cover what the fast path takes and what it must leave
// to net/http.
var fastResponseSeeds = []string{
	"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}",
	"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length:  2 \r\nx-request-id:\tabc\t\r\n\r\n{}next",
	"HTTP/1.1 404\r\nContent-Length: 0\r\n\r\n",
	"HTTP/1.1 500 Internal Server Error\r\nServer: uvicorn\r\nDate: Wed, 02 Dec 2026 14:00:00 GMT\r\nContent-Length: 5\r\n\r\nshort",
	"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 2\r\n\r\n{}",
	"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\n{}",
	"HTTP/1.1 200 OK\r\nContent-Length: +2\r\n\r\n{}",
	"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
	"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}",
	"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nPragma: no-cache\r\n\r\n{}",
	"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n folded\r\n\r\n{}",
	"HTTP/1.1 200 OK\r\nContent-Length : 2\r\n\r\n{}",
	"HTTP/1.1 200 OK\r\nX-A: a\nContent-Length: 2\r\n\r\n{}",
	"HTTP/1.1 200 OK\r\nX-A: \x01\r\nContent-Length: 2\r\n\r\n{}",
	"HTTP/1.1 204 No Content\r\nContent-Length: 2\r\n\r\n",
	"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n",
	"HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\n{}",
	"HTTP/1.1 20x OK\r\nContent-Length: 2\r\n\r\n{}",
	"HTTP/1.1 200OK\r\nContent-Length: 2\r\n\r\n{}",
	"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n",
	"HTTP/1.1 200 OK\r\nContent-Length: 99999999999999999999\r\n\r\n",
	"HTTP/1.1 200 OK\r\nSet-Cookie: a\r\nSet-Cookie: b\r\nContent-Length: 0\r\n\r\n",
}

// FuzzFastResponse holds readResponseFast to http.ReadResponse: whatever
// head it takes, net/http parses to the same status, header, framing and
// body, and it consumes the same bytes.
func FuzzFastResponse(f *testing.F) {
	for _, s := range fastResponseSeeds {
		f.Add([]byte(s), false)
	}
	f.Add([]byte(fastResponseSeeds[0]), true)
	f.Fuzz(func(t *testing.T, raw []byte, head bool) {
		compareFastResponse(t, raw, head)
	})
}

func TestFastResponseMatchesNetHTTP(t *testing.T) {
	took := 0
	for _, s := range fastResponseSeeds {
		if compareFastResponse(t, []byte(s), false) {
			took++
		}
	}
	if took < 4 {
		t.Errorf("the fast path took %d of the seed responses, want the 4 plain ones at least", took)
	}
}

// compareFastResponse reports whether the fast path took raw, failing t
// if it disagrees with net/http.
func compareFastResponse(t *testing.T, raw []byte, head bool) bool {
	t.Helper()
	method := http.MethodPost
	if head {
		method = http.MethodHead
	}
	req, _ := http.NewRequest(method, "http://endpoint/v1/completions", nil)
	br := bufio.NewReader(bytes.NewReader(raw))
	if _, err := br.Peek(1); err != nil {
		return false
	}
	ur := readResponseFast(br, req)
	if ur == nil {
		if br.Buffered() != len(raw) && br.Buffered() != 4096 {
			t.Fatalf("declined but consumed bytes of %q", raw)
		}
		return false
	}
	got := &ur.resp
	gotBody, gotErr := io.ReadAll(got.Body)
	rest, _ := io.ReadAll(br)

	wbr := bufio.NewReader(bytes.NewReader(raw))
	want, err := http.ReadResponse(wbr, req)
	if err != nil {
		t.Fatalf("fast path took %q, net/http refuses it: %v", raw, err)
	}
	wantBody, wantErr := io.ReadAll(want.Body)
	wantRest, _ := io.ReadAll(wbr)
	if got.Status != want.Status || got.StatusCode != want.StatusCode || got.Proto != want.Proto ||
		got.ProtoMajor != want.ProtoMajor || got.ProtoMinor != want.ProtoMinor ||
		got.ContentLength != want.ContentLength || got.Close != want.Close ||
		len(got.TransferEncoding) != 0 || len(want.TransferEncoding) != 0 || want.Trailer != nil {
		t.Fatalf("%q: fast %q %d %s cl=%d close=%v, net/http %q %d %s cl=%d close=%v te=%v",
			raw, got.Status, got.StatusCode, got.Proto, got.ContentLength, got.Close,
			want.Status, want.StatusCode, want.Proto, want.ContentLength, want.Close, want.TransferEncoding)
	}
	if !reflect.DeepEqual(got.Header, want.Header) {
		t.Fatalf("%q: header %v, net/http %v", raw, got.Header, want.Header)
	}
	if !bytes.Equal(gotBody, wantBody) || (gotErr == nil) != (wantErr == nil) || !bytes.Equal(rest, wantRest) {
		t.Fatalf("%q: body %q (%v) then %q, net/http %q (%v) then %q", raw, gotBody, gotErr, rest, wantBody, wantErr, wantRest)
	}
	if strings.Contains(got.Status, "\r") {
		t.Fatalf("status %q", got.Status)
	}
	return true
}
