package proxy

import "net/http"

// flowWriter stands between a Plan.Dispatch flow and the client. A flow
// writes its client-facing response (the decode leg's relay, or a context
// leg that finished the request, or an engine's error it passes on)
// through it, so the proxy sees those bytes as it sees a single-endpoint
// relay: the plan's FirstByte fires once, at the first body byte, which
// lets the gateway release the followers coalesced behind a P/D leader as
// soon as prefill is over instead of at CoalesceWait; and the usage tap
// reads the usage block the engine sent, so Result (hence Plan.Done and
// loxilb_ai_usage_reported_total) carries prompt and cached tokens for
// disaggregated services too.
//
// Only what reaches the client is read. A prefill leg's own answer is
// consumed by the flow and never written here, so its usage is not
// counted: single-endpoint requests count one usage block per response the
// client got, and counting the prefill's as well would count P/D requests
// twice. The endpoint label is Result.Endpoint, the endpoint that served
// the client-facing response (the decode endpoint; the context endpoint
// when TensorRT-LLM finished the request there).
//
// Error answers the proxy writes for the flow (WriteError) are its own, not
// an endpoint's: they neither fire FirstByte nor are scanned, as on the
// single-endpoint path. All writes come from the goroutine running
// Dispatch, as a ResponseWriter requires.
type flowWriter struct {
	w         http.ResponseWriter
	firstByte func()
	tap       usageTap
	scan      bool // the response is JSON or an event stream
	own       bool // the proxy's own error answer
	wrote     bool // the status line went out
}

// runFlow hands the exchange to the plan's flow through a flowWriter and
// completes the flow's Result with the usage its response carried.
func (ex *exchange) runFlow(req *Request) Result {
	fw := &flowWriter{w: ex.w, firstByte: ex.plan.FirstByte, tap: usageTap{limit: ex.t.cfg.UsageScanBytes}}
	defer fw.tap.release()
	res := ex.plan.Dispatch(ex.ctx, fw, req)
	if fw.scan && !res.HasUsage {
		fw.tap.finish(&res)
	}
	return res
}

func (fw *flowWriter) Header() http.Header { return fw.w.Header() }

func (fw *flowWriter) WriteHeader(code int) {
	if !fw.wrote {
		fw.wrote = true
		h := fw.w.Header()
		fw.tap.sse = isEventStream(h)
		fw.scan = !fw.own && (fw.tap.sse || isJSON(h))
	}
	fw.w.WriteHeader(code)
}

func (fw *flowWriter) Write(p []byte) (int, error) {
	if !fw.wrote {
		fw.WriteHeader(http.StatusOK) // as net/http does on a first Write
	}
	if len(p) > 0 && !fw.own {
		if fb := fw.firstByte; fb != nil {
			fw.firstByte = nil
			fb()
		}
		if fw.scan {
			fw.tap.Write(p)
		}
	}
	return fw.w.Write(p)
}

// Flush passes on to the client's writer: flows flush every SSE event.
func (fw *flowWriter) Flush() {
	if f, ok := fw.w.(http.Flusher); ok {
		f.Flush()
	}
}

// Unwrap lets http.ResponseController reach the client's writer.
func (fw *flowWriter) Unwrap() http.ResponseWriter { return fw.w }

// markOwn records that the proxy answers for the flow itself (an error),
// unless an endpoint's response is already being relayed.
func markOwn(w http.ResponseWriter) {
	if fw, ok := w.(*flowWriter); ok && !fw.wrote {
		fw.own = true
	}
}
