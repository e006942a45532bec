package proxy

import (
	"bufio"
	"errors"
	"fmt"
	"io"
)

// Request body errors of the lean server. They reach the handler through
// Read and become 400s there (ErrBadRequest), as net/http's do.
var (
	errChunkedSyntax = errors.New("malformed chunked encoding")
	errTrailerSize   = errors.New("chunked trailer section too large")
)

// maxTrailerBytes bounds the trailer section of a chunked request body,
// which the proxy reads and discards (the body it relays is buffered and
// sent with a Content-Length).
const maxTrailerBytes = 64 << 10

// h1Body is the request body of the lean server: Content-Length framed or
// chunked, read from the connection's buffer. One lives in each h1Conn and
// is reset per request.
type h1Body struct {
	c        *h1Conn
	left     int64 // Content-Length bytes, or bytes of the current chunk, still to read
	chunked  bool
	done     bool // the body was read to its end
	err      error
	cont     bool // send 100 Continue before the first read
	trailers int  // trailer bytes read
}

func (b *h1Body) reset(c *h1Conn, hd *h1Head) {
	*b = h1Body{c: c, left: hd.contentLength, chunked: hd.chunked, cont: hd.expectContinue}
	if !hd.chunked && hd.contentLength == 0 {
		b.done = true
	}
	if hd.chunked {
		b.left = 0
	}
}

func (b *h1Body) Read(p []byte) (int, error) {
	if b.done {
		return 0, io.EOF
	}
	if b.err != nil {
		return 0, b.err
	}
	if b.cont {
		b.cont = false
		b.c.bw.WriteString("HTTP/1.1 100 Continue\r\n\r\n")
		if err := b.c.bw.Flush(); err != nil {
			b.err = err
			return 0, err
		}
	}
	if b.chunked && b.left == 0 {
		if err := b.nextChunk(); err != nil {
			b.err = err
			return 0, err
		}
		if b.done {
			return 0, io.EOF
		}
	}
	if int64(len(p)) > b.left {
		p = p[:b.left]
	}
	n, err := b.c.br.Read(p)
	b.left -= int64(n)
	if b.left == 0 && !b.chunked {
		b.done = true
		return n, io.EOF
	}
	if b.left == 0 && b.chunked {
		if cerr := b.chunkEnd(); cerr != nil {
			b.err = cerr
			return n, cerr
		}
	}
	if err == io.EOF {
		err = io.ErrUnexpectedEOF
	}
	if err != nil {
		b.err = err
	}
	return n, err
}

func (b *h1Body) Close() error { return nil }

// buffered reports whether the rest of a Content-Length body is already
// in the connection's read buffer: reading it cannot wait on the client,
// so it needs no read deadline.
func (b *h1Body) buffered() bool {
	return !b.chunked && !b.cont && b.err == nil && b.left <= int64(b.c.br.Buffered())
}

// line reads one CRLF-terminated line of the chunked framing, without it.
func (b *h1Body) line() ([]byte, error) {
	l, err := b.c.br.ReadSlice('\n')
	if err != nil {
		if err == io.EOF {
			return nil, io.ErrUnexpectedEOF
		}
		if errors.Is(err, bufio.ErrBufferFull) {
			return nil, fmt.Errorf("%w: line too long", errChunkedSyntax)
		}
		return nil, err
	}
	if len(l) < 2 || l[len(l)-2] != '\r' {
		return nil, fmt.Errorf("%w: line not ended by CRLF", errChunkedSyntax)
	}
	l = l[:len(l)-2]
	// A bare CR inside the line (in an extension, say) is refused, as
	// net/http refuses it: two parsers must never split a body differently.
	if indexByte(l, '\r') >= 0 {
		return nil, fmt.Errorf("%w: bare CR in chunked line", errChunkedSyntax)
	}
	return l, nil
}

// nextChunk reads a chunk-size line; after the last chunk it reads the
// trailer section and marks the body done.
func (b *h1Body) nextChunk() error {
	l, err := b.line()
	if err != nil {
		return err
	}
	// White space is trimmed from the line's end before the extension is
	// cut, and not before the ';': "3 ;x" is refused, as net/http refuses
	// it, so two parsers never disagree on where a chunk ends.
	for len(l) > 0 && (l[len(l)-1] == ' ' || l[len(l)-1] == '\t') {
		l = l[:len(l)-1]
	}
	if i := indexByte(l, ';'); i >= 0 {
		l = l[:i] // chunk extensions mean nothing to the proxy
	}
	if len(l) == 0 || len(l) > 15 {
		return fmt.Errorf("%w: bad chunk size", errChunkedSyntax)
	}
	var n int64
	for _, c := range l {
		var d byte
		switch {
		case '0' <= c && c <= '9':
			d = c - '0'
		case 'a' <= c && c <= 'f':
			d = c - 'a' + 10
		case 'A' <= c && c <= 'F':
			d = c - 'A' + 10
		default:
			return fmt.Errorf("%w: bad chunk size", errChunkedSyntax)
		}
		n = n<<4 | int64(d)
	}
	if n > 0 {
		b.left = n
		return nil
	}
	for {
		t, err := b.line()
		if err != nil {
			return err
		}
		b.trailers += len(t) + 2
		if b.trailers > maxTrailerBytes {
			return errTrailerSize
		}
		if len(t) == 0 {
			b.done = true
			return nil
		}
	}
}

// chunkEnd reads the CRLF after a chunk's data.
func (b *h1Body) chunkEnd() error {
	crlf, err := b.c.br.Peek(2)
	if err != nil {
		if err == io.EOF {
			return io.ErrUnexpectedEOF
		}
		return err
	}
	if crlf[0] != '\r' || crlf[1] != '\n' {
		return fmt.Errorf("%w: chunk not ended by CRLF", errChunkedSyntax)
	}
	_, _ = b.c.br.Discard(2)
	return nil
}

func indexByte(b []byte, c byte) int {
	for i, x := range b {
		if x == c {
			return i
		}
	}
	return -1
}
