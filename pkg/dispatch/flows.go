package dispatch

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"net/http"
	"strconv"
	"strings"

	"github.com/loxilb-llm/loxilb/pkg/engine"
	"github.com/loxilb-llm/loxilb/pkg/proxy"
)

// ---- vLLM (NixlConnector), sequential ----

// vllmPrefillBody is the toy proxy's prefill rewrite: remote decode asked
// for, one token, no streaming, and the min-token fields removed (the
// decode leg gets the original body, which still has them).
func vllmPrefillBody(m map[string]json.RawMessage) []byte {
	p := cloneBody(m)
	p["kv_transfer_params"] = json.RawMessage(`{"do_remote_decode":true,"do_remote_prefill":false,"remote_engine_id":null,"remote_block_ids":null,"remote_host":null,"remote_port":null}`)
	p["stream"] = json.RawMessage("false")
	p["max_tokens"] = json.RawMessage("1")
	if _, ok := p["max_completion_tokens"]; ok {
		p["max_completion_tokens"] = json.RawMessage("1")
	}
	delete(p, "stream_options")
	delete(p, "min_tokens")
	delete(p, "min_completion_tokens")
	return encodeBody(p)
}

// vllmParams extracts kv_transfer_params from a prefill response and
// points remote_host/remote_port at the prefill endpoint (nixl_port, or the
// target port when it is 0). The rest of the object is forwarded as is.
// reported is the remote_port the engine gave (its NIXL side channel), 0
// when absent or not a port: diagnostics compare it with what was sent.
func vllmParams(body []byte, ep Endpoint, limit int) (params json.RawMessage, reported int, err error) {
	var top map[string]json.RawMessage
	if err := json.Unmarshal(body, &top); err != nil {
		return nil, 0, fmt.Errorf("%w: prefill response is not a JSON object: %v", proxy.ErrParamsMalformed, err)
	}
	kv, ok := top["kv_transfer_params"]
	if !ok || isNull(kv) {
		return nil, 0, fmt.Errorf("%w: prefill returned no kv_transfer_params (is the prefill engine running with a NixlConnector kv_transfer_config and kv_role kv_producer or kv_both?)", proxy.ErrParamsMissing)
	}
	if len(kv) > limit {
		return nil, 0, fmt.Errorf("%w: kv_transfer_params is %d bytes, over the %d byte cap", proxy.ErrParamsMalformed, len(kv), limit)
	}
	var p map[string]json.RawMessage
	if err := json.Unmarshal(kv, &p); err != nil || p == nil {
		return nil, 0, fmt.Errorf("%w: kv_transfer_params must be a JSON object, got %s", proxy.ErrParamsMalformed, excerpt(kv))
	}
	if len(p) == 0 {
		return nil, 0, fmt.Errorf("%w: kv_transfer_params is empty", proxy.ErrParamsMalformed)
	}
	if err := checkKind(p, "remote_block_ids", '['); err != nil {
		return nil, 0, err
	}
	if err := checkKind(p, "remote_engine_id", '"'); err != nil {
		return nil, 0, err
	}
	if v, ok := p["do_remote_prefill"]; ok && string(v) != "true" {
		return nil, 0, fmt.Errorf("%w: kv_transfer_params.do_remote_prefill is %s, want true", proxy.ErrParamsMalformed, excerpt(v))
	}
	if v, ok := p["remote_port"]; ok {
		if n, err := strconv.Atoi(strings.Trim(string(bytes.TrimSpace(v)), `"`)); err == nil && n > 0 && n <= 65535 {
			reported = n
		}
	}
	port := ep.NixlPort
	if port == 0 {
		port = ep.Port
	}
	p["remote_host"] = raw(ep.Host)
	p["remote_port"] = raw(port)
	return raw(p), reported, nil
}

func isNull(b json.RawMessage) bool {
	return len(bytes.TrimSpace(b)) == 0 || string(bytes.TrimSpace(b)) == "null"
}

// checkKind requires field k, when present and not null, to start with the
// given JSON delimiter ('[' array, '"' string, '{' object).
func checkKind(p map[string]json.RawMessage, k string, want byte) error {
	v, ok := p[k]
	if !ok || isNull(v) {
		return nil
	}
	if t := bytes.TrimSpace(v); t[0] != want {
		return fmt.Errorf("%w: %s has the wrong type: %s", proxy.ErrParamsMalformed, k, excerpt(t))
	}
	return nil
}

func (x *exchange) paramsError(ep Endpoint, err error) {
	epl := strconv.Itoa(ep.Idx)
	if errors.Is(err, proxy.ErrParamsMissing) {
		x.d.m.paramsMissing.WithLabelValues(x.label, epl).Inc()
		x.outcomeTag = "params_missing"
	} else {
		x.d.m.paramsBad.WithLabelValues(x.label, epl).Inc()
		x.outcomeTag = "params_malformed"
	}
	x.fail(context.Background(), fmt.Errorf("prefill endpoint %s: %w", ep.Addr(), err))
}

func (x *exchange) runVLLM(ctx context.Context) {
	x.reqID = requestID(x.req.Header)
	pb := vllmPrefillBody(x.body)
	out := x.runPrefill(ctx, func(Endpoint) []byte { return pb })
	if out.err != nil || out.status/100 != 2 {
		x.failPrefill(ctx, out)
		return
	}
	params, reported, err := vllmParams(out.body, out.ep, x.d.cfg.MaxParamsBytes)
	if err != nil {
		x.paramsError(out.ep, err)
		return
	}
	if reported != 0 {
		x.d.sidePorts.Store(sideKey{x.req.Pool.Service, out.ep.Idx}, reported)
	}
	x.d.m.paramsFound.WithLabelValues(x.label, strconv.Itoa(out.ep.Idx)).Inc()
	x.prefillUsed = &out.ep
	db := cloneBody(x.body)
	db["kv_transfer_params"] = params
	x.decode(ctx, encodeBody(db))
}

// decode runs the decode leg and records its failure.
func (x *exchange) decode(ctx context.Context, body []byte) {
	if err := x.decodeLeg(ctx, body); err != nil {
		x.decodeFailed(ctx, err)
	}
}

// ---- SGLang, concurrent legs sharing a bootstrap room ----

// sglangBody adds bootstrap_host/port/room to the body sent to both legs;
// a batched prompt gets one entry per prompt.
func sglangBody(m map[string]json.RawMessage, host string, port int, room uint64) []byte {
	p := cloneBody(m)
	if n := batchSize(m); n > 0 {
		hosts, ports, rooms := make([]string, n), make([]int, n), make([]uint64, n)
		for i := range n {
			hosts[i], ports[i], rooms[i] = host, port, (room+uint64(i))&(1<<63-1)
		}
		p["bootstrap_host"], p["bootstrap_port"], p["bootstrap_room"] = raw(hosts), raw(ports), raw(rooms)
	} else {
		p["bootstrap_host"], p["bootstrap_port"], p["bootstrap_room"] = raw(host), raw(port), raw(room)
	}
	return encodeBody(p)
}

// sglangBodies are the bodies of the two legs: the same bootstrap fields
// for both and, when the gateway names the prefill rank of pre (one
// prompt only: a batch's rooms spread over ranks), that rank for the
// prefill server to serve the leg on and for the decode server to fetch
// the KV cache from. The room is also made congruent to the rank, so an
// engine that places a prefill by bootstrap_room modulo its ranks agrees.
func (x *exchange) sglangBodies(pre Endpoint, port int, room uint64) (preBody, decBody []byte) {
	rank, ranks, ok := 0, 0, false
	if x.req.PrefillRank != nil && batchSize(x.body) == 0 {
		rank, ranks, ok = x.req.PrefillRank(pre.Idx)
	}
	if !ok || ranks < 1 || rank < 0 || rank >= ranks {
		b := sglangBody(x.body, pre.Host, port, room)
		return b, b
	}
	n := uint64(ranks)
	room = room / n * n
	if room > 1<<63-1-n {
		room -= n
	}
	room += uint64(rank)
	r := raw(rank)
	p := cloneBody(x.body)
	p[engine.SGLangRankField], p[engine.SGLangLegacyRankField] = r, r
	d := cloneBody(x.body)
	d[engine.SGLangPrefillRankField] = r
	return sglangBody(p, pre.Host, port, room), sglangBody(d, pre.Host, port, room)
}

// batchSize is the number of prompts of a batched request (a list of
// strings or of token lists in prompt, text or input_ids); 0 for one prompt.
func batchSize(m map[string]json.RawMessage) int {
	for _, k := range []string{"prompt", "text", "input_ids"} {
		v, ok := m[k]
		if !ok {
			continue
		}
		var items []json.RawMessage
		if json.Unmarshal(v, &items) != nil || len(items) == 0 {
			return 0
		}
		if t := bytes.TrimSpace(items[0]); len(t) > 0 && (t[0] == '"' || t[0] == '[') {
			return len(items)
		}
		return 0
	}
	return 0
}

func (x *exchange) runSGLang(ctx context.Context) {
	x.reqID = requestID(x.req.Header)
	port := x.req.Pool.BootstrapPort
	if port == 0 {
		port = DefaultBootstrapPort
	}
	for i, pre := range x.c.Prefill {
		room := rand.Uint64() >> 1 // uniform in [0, 2^63-1]
		preBody, decBody := x.sglangBodies(pre, port, room)
		x.res.Attempts++
		last := i == len(x.c.Prefill)-1
		if !x.sglangAttempt(ctx, pre, preBody, decBody, last) {
			return
		}
		x.d.m.failover.WithLabelValues(x.label, strconv.Itoa(pre.Idx)).Inc()
		x.d.logger.Debug("dispatch: prefill connect failed, trying next endpoint with a fresh room",
			"service", x.req.Pool.Service, "ep", pre.Idx, "next", x.c.Prefill[i+1].Idx)
	}
}

// sglangAttempt sends both legs at once. The decode leg is relayed to the
// client; the prefill response is read and discarded. A failed prefill
// cancels the decode leg and vice versa. retry is true when the prefill
// endpoint could not be connected to and nothing reached the client, so
// the caller may try the next prefill endpoint with a fresh room (never
// for the last candidate: that failure is answered here).
func (x *exchange) sglangAttempt(ctx context.Context, pre Endpoint, preBody, decBody []byte, last bool) (retry bool) {
	lctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	prefillDone := make(chan prefillOutcome, 1)
	go func() {
		out := x.prefillOnce(lctx, pre, preBody)
		if out.err != nil || out.status/100 != 2 {
			cancel(errOtherLeg)
		}
		prefillDone <- out
	}()
	derr := x.decodeLeg(lctx, decBody)
	if derr == nil {
		// Drain: the client has its answer; wait for the prefill leg so its
		// slot and connection are released cleanly (bounded by its timeout).
		out := <-prefillDone
		if out.err == nil && out.status/100 == 2 {
			x.prefillUsed = &pre
		}
		return false
	}
	cancel(errOtherLeg)
	out := <-prefillDone
	prefillFailed := out.err != nil && !errors.Is(out.err, errOtherLeg) && !errors.Is(out.err, context.Canceled) || out.err == nil && out.status/100 != 2
	if prefillFailed && x.wrote {
		// Bytes already went out: cut the stream, blaming the prefill.
		x.d.m.streamAborted.WithLabelValues(x.label, strconv.Itoa(x.c.Decode.Idx)).Inc()
		x.outcomeTag = "stream_aborted"
		x.fail(ctx, out.error())
		return false
	}
	if !prefillFailed {
		x.decodeFailed(ctx, derr)
		return false
	}
	if out.connectFailed && !last && ctx.Err() == nil {
		return true
	}
	x.outcomeTag = "prefill_error"
	x.failPrefill(ctx, out)
	return false
}

func (x *exchange) decodeFailed(ctx context.Context, err error) {
	if ctx.Err() != nil || errors.Is(err, proxy.ErrClientCanceled) {
		x.outcomeTag = "" // derived: client_canceled
	} else if x.outcomeTag == "" {
		x.outcomeTag = "decode_error"
		if x.wrote {
			x.outcomeTag = "stream_aborted"
		}
	}
	x.fail(ctx, err)
}

// ---- TensorRT-LLM, context then generation ----

func trtContextBody(m map[string]json.RawMessage) []byte {
	p := cloneBody(m)
	p["disaggregated_params"] = json.RawMessage(`{"request_type":"context_only"}`)
	p["stream"] = json.RawMessage("false")
	delete(p, "stream_options")
	p["max_tokens"] = json.RawMessage("1")
	if _, ok := p["max_completion_tokens"]; ok {
		p["max_completion_tokens"] = json.RawMessage("1")
	}
	return encodeBody(p)
}

// trtContext is what the flow needs of a context response.
type trtContext struct {
	finish string
	params json.RawMessage // with request_type set to generation_only
}

func parseTRTContext(body []byte, limit int) (trtContext, error) {
	var resp struct {
		Choices []struct {
			FinishReason *string         `json:"finish_reason"`
			Params       json.RawMessage `json:"disaggregated_params"`
		} `json:"choices"`
	}
	if err := json.Unmarshal(body, &resp); err != nil {
		return trtContext{}, fmt.Errorf("%w: context response is not a completion object: %v", proxy.ErrParamsMalformed, err)
	}
	if len(resp.Choices) != 1 {
		return trtContext{}, fmt.Errorf("%w: context response has %d choices, want 1", proxy.ErrParamsMalformed, len(resp.Choices))
	}
	ch := resp.Choices[0]
	var c trtContext
	if ch.FinishReason != nil {
		c.finish = *ch.FinishReason
	}
	if trtFinished(c.finish) {
		return c, nil
	}
	if isNull(ch.Params) {
		return c, fmt.Errorf("%w: context response choice has no disaggregated_params (is the server a context_only TensorRT-LLM worker?)", proxy.ErrParamsMissing)
	}
	if len(ch.Params) > limit {
		return c, fmt.Errorf("%w: disaggregated_params is %d bytes, over the %d byte cap", proxy.ErrParamsMalformed, len(ch.Params), limit)
	}
	var p map[string]json.RawMessage
	if err := json.Unmarshal(ch.Params, &p); err != nil || p == nil {
		return c, fmt.Errorf("%w: disaggregated_params must be a JSON object, got %s", proxy.ErrParamsMalformed, excerpt(ch.Params))
	}
	if err := checkKind(p, "first_gen_tokens", '['); err != nil {
		return c, err
	}
	if err := checkKind(p, "encoded_opaque_state", '"'); err != nil {
		return c, err
	}
	if v, ok := p["ctx_request_id"]; !ok || isNull(v) {
		return c, fmt.Errorf("%w: disaggregated_params lacks ctx_request_id", proxy.ErrParamsMalformed)
	}
	p["request_type"] = json.RawMessage(`"generation_only"`)
	c.params = raw(p)
	return c, nil
}

// trtFinished: TensorRT-LLM's disaggregated server returns the context
// response itself when the context leg already ended the request (stop
// token, stop string), i.e. finish_reason is neither "length" (the one
// token it was allowed) nor "not_finished".
func trtFinished(finish string) bool {
	return finish != "" && finish != "length" && finish != "not_finished"
}

func (x *exchange) runTRT(ctx context.Context) {
	x.reqID = requestID(x.req.Header)
	cb := trtContextBody(x.body)
	out := x.runPrefill(ctx, func(Endpoint) []byte { return cb })
	if out.err != nil || out.status/100 != 2 {
		x.failPrefill(ctx, out)
		return
	}
	c, err := parseTRTContext(out.body, x.d.cfg.MaxParamsBytes)
	if err != nil {
		x.paramsError(out.ep, err)
		return
	}
	x.prefillUsed = &out.ep
	if c.params == nil {
		// Finished in the context leg.
		x.d.m.earlyExit.WithLabelValues(x.label).Inc()
		x.outcomeTag = "early_exit"
		x.res.Endpoint = out.ep.Idx
		x.relayContext(out)
		return
	}
	x.d.m.paramsFound.WithLabelValues(x.label, strconv.Itoa(out.ep.Idx)).Inc()
	gb := cloneBody(x.body)
	gb["disaggregated_params"] = c.params
	x.decode(ctx, encodeBody(gb))
}

// relayContext answers with the context response; a streaming client gets
// it as one SSE chunk followed by [DONE].
func (x *exchange) relayContext(out prefillOutcome) {
	if s, ok := x.body["stream"]; !ok || string(bytes.TrimSpace(s)) != "true" {
		h := http.Header{"Content-Type": {"application/json"}}
		x.relayBuffered(out.status, h, out.body)
		return
	}
	sse, err := completionToSSE(out.body)
	if err != nil {
		x.fail(context.Background(), &proxy.LegError{Leg: legPrefill, Addr: out.ep.Addr(), Err: fmt.Errorf("%w: context response: %v", proxy.ErrUpstreamProtocol, err)})
		return
	}
	h := http.Header{"Content-Type": {"text/event-stream"}, "Cache-Control": {"no-cache"}}
	x.relayBuffered(http.StatusOK, h, sse)
	x.res.Streamed = true
}

// completionToSSE turns a completion object into the streaming form: one
// chunk carrying the whole choice (delta for chat), then [DONE].
func completionToSSE(body []byte) ([]byte, error) {
	var obj map[string]any
	dec := json.NewDecoder(bytes.NewReader(body))
	dec.UseNumber()
	if err := dec.Decode(&obj); err != nil {
		return nil, err
	}
	chat := obj["object"] == "chat.completion"
	if chat {
		obj["object"] = "chat.completion.chunk"
	}
	choices, _ := obj["choices"].([]any)
	for _, c := range choices {
		ch, ok := c.(map[string]any)
		if !ok {
			continue
		}
		delete(ch, "disaggregated_params")
		if msg, ok := ch["message"]; ok && chat {
			ch["delta"] = msg
			delete(ch, "message")
		}
	}
	delete(obj, "usage")
	b, err := json.Marshal(obj)
	if err != nil {
		return nil, err
	}
	var buf bytes.Buffer
	buf.WriteString("data: ")
	buf.Write(b)
	buf.WriteString("\n\ndata: [DONE]\n\n")
	return buf.Bytes(), nil
}
