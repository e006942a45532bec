//go:build !linux

package proxy

// alive reports whether an idle pooled connection can carry another
// request. Without a portable non-blocking peek, only stray buffered
// bytes disqualify it; a connection the endpoint closed is detected when
// the request write fails, and retried on a fresh connection.
func (pc *pconn) alive() bool { return pc.br.Buffered() == 0 }

// peekProbe is the Linux liveness probe's state; unused here.
type peekProbe struct{}
