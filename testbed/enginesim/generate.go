package enginesim

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"hash/fnv"
	"net/http"
	"strings"
	"time"
)

// errAbortConn asks the handler to drop the connection (close-mid-stream).
var errAbortConn = errors.New("connection closed by fault injection")

type usage struct {
	PromptTokens        int `json:"prompt_tokens"`
	TotalTokens         int `json:"total_tokens"`
	CompletionTokens    int `json:"completion_tokens"`
	PromptTokensDetails struct {
		CachedTokens int `json:"cached_tokens"`
	} `json:"prompt_tokens_details"`
}

// generate serves one completion: P/D checks, admission, prefix-cache match,
// modelled prefill of the uncached tokens, cache insert with events, then
// modelled decode and the response.
func (e *Engine) generate(w *trackingWriter, r *http.Request, chat bool) error {
	if err := e.requestFaults(w, r); err != nil {
		return err
	}
	p, err := e.parse(r, chat)
	if err != nil {
		return err
	}
	s, err := e.serve(r.Context(), r, p)
	if err != nil {
		return err
	}
	defer s.done()
	abort := e.faults.takeCloseMidStream()
	if p.Stream && !s.plan.prefillOnly {
		return e.stream(w, r, p, s.out, s.u, abort)
	}
	if err := e.sleep(r.Context(), e.decodeTime(len(s.out))); err != nil {
		return err
	}
	if abort {
		return errAbortConn
	}
	writeJSON(w, 200, e.completionBody(p, s.out, s.u, s.extras))
	return nil
}

// requestFaults applies the injected per-request faults: a connection
// reset, a stall, an error status.
func (e *Engine) requestFaults(w *trackingWriter, r *http.Request) error {
	if e.faults.takeReset() {
		return resetConn(w, r)
	}
	status, stall := e.faults.requestFault()
	if stall > 0 {
		t := time.NewTimer(stall)
		select {
		case <-t.C:
		case <-r.Context().Done():
			t.Stop()
			return r.Context().Err()
		}
	}
	if status != 0 {
		return injectedError{status: status}
	}
	return nil
}

// decodeTime is the modelled duration of n decode steps at the current load.
func (e *Engine) decodeTime(n int) time.Duration {
	var total time.Duration
	for i := 0; i < n; i++ {
		total += e.decodeStep()
	}
	return total
}

// served is one prompt's run through the engine: what its response
// reports, and done, which frees its scheduler slot and cache holds once
// the response is written.
type served struct {
	plan   pdPlan
	out    []uint32
	u      usage
	extras pdExtras
	done   func()
}

// serve runs one prompt up to its first output: P/D checks, admission,
// prefix-cache match, modelled prefill, cache insert with events.
func (e *Engine) serve(ctx context.Context, r *http.Request, p *parsedRequest) (served, error) {
	plan, err := e.pdBefore(ctx, p)
	if err != nil {
		return served{}, err
	}
	rk, err := e.pickRank(r, p)
	if err != nil {
		return served{}, err
	}
	rk.waiting.Add(1)
	err = e.sched.acquire(ctx)
	rk.waiting.Add(-1)
	if err != nil {
		return served{}, err
	}
	rk.running.Add(1)
	bs := e.cfg.BlockSize
	hbs := e.hashPrompt(p)
	rk.mu.Lock()
	// As in vLLM, the last prompt token is always computed, so a full hit
	// stops one block short when the prompt is block aligned.
	n := rk.cache.match(hbs, (len(p.tokens)-1)/bs)
	held := rk.cache.acquire(hbs, n)
	rk.mu.Unlock()
	e.queries.Add(1)
	e.activeBlocks.Add(int64(len(held)))
	done := func() {
		rk.mu.Lock()
		rk.cache.release(held)
		rk.mu.Unlock()
		e.activeBlocks.Add(-int64(len(held)))
		rk.running.Add(-1)
		e.sched.release()
	}
	cached := n * bs
	e.promptTok.Add(uint64(len(p.tokens)))
	e.hitTok.Add(uint64(cached))

	if !plan.remotePrefilled {
		cost := time.Duration(e.cfg.PrefillUsPerToken * float64(len(p.tokens)-cached) * float64(time.Microsecond))
		if err := e.sleep(ctx, cost); err != nil {
			done()
			return served{}, err
		}
	}
	toInsert := hbs
	if sh, ok := e.hasher.(*sglangHasher); ok && e.cfg.SGLangPartialPages {
		if pp, ok := sh.partialPage(p.tokens, hbs); ok {
			toInsert = append(hbs[:len(hbs):len(hbs)], pp)
		}
	}
	rk.mu.Lock()
	var evs []kvEvent
	before := len(held)
	held, evs = rk.cache.insert(toInsert, held)
	e.emit(rk, evs)
	rk.mu.Unlock()
	e.activeBlocks.Add(int64(len(held) - before))

	outN := p.maxTokens
	if plan.prefillOnly {
		outN = 1
	}
	s := served{plan: plan, extras: e.pdAfter(p, plan), out: outputTokens(p.tokens, outN), done: done}
	s.u = usage{PromptTokens: len(p.tokens), CompletionTokens: outN, TotalTokens: len(p.tokens) + outN}
	s.u.PromptTokensDetails.CachedTokens = cached
	e.outputTok.Add(uint64(outN))
	return s, nil
}

// hashPrompt keys the prompt's blocks; vLLM mixes a LoRA name and a
// cache_salt into the hashes (SGLang and TensorRT-LLM salts are not
// emulated: their hashing of salted pages differs between versions).
func (e *Engine) hashPrompt(p *parsedRequest) []hashedBlock {
	if vh, ok := e.hasher.(*vllmHasher); ok && e.cfg.Engine == EngineVLLM {
		x := blockExtras{lora: e.lora(p.Model)}
		if p.CacheSalt != nil {
			x.cacheSalt = *p.CacheSalt
		}
		if x.lora != nil || x.cacheSalt != "" {
			return vh.hashBlocksExtra(p.tokens, x)
		}
	}
	return e.hasher.hashBlocks(p.tokens)
}

// decodeStep is the modelled duration of one decode step at the current load.
func (e *Engine) decodeStep() time.Duration {
	us := e.cfg.DecodeUsPerToken + e.cfg.DecodeUsPerActiveBlock*float64(e.activeBlocks.Load())
	return time.Duration(us * float64(time.Microsecond))
}

// outputTokens makes deterministic synthetic output ids from the prompt.
func outputTokens(prompt []uint32, n int) []uint32 {
	h := fnv.New64a()
	var b [4]byte
	for _, t := range prompt {
		b[0], b[1], b[2], b[3] = byte(t), byte(t>>8), byte(t>>16), byte(t>>24)
		h.Write(b[:])
	}
	seed := h.Sum64()
	out := make([]uint32, n)
	for i := range out {
		seed = seed*6364136223846793005 + 1442695040888963407
		out[i] = uint32(seed>>33) % uint32(len(outputWords))
	}
	return out
}

var outputWords = []string{"the", "cache", "block", "prefix", "token", "engine", "route", "model",
	"decode", "prefill", "event", "batch", "queue", "hash", "page", "rank"}

func tokenText(t uint32) string { return " " + outputWords[int(t)%len(outputWords)] }

func (e *Engine) ids(p *parsedRequest) (id, object, chunkObject string) {
	if p.chat {
		return "chatcmpl-" + p.requestID, "chat.completion", "chat.completion.chunk"
	}
	return "cmpl-" + p.requestID, "text_completion", "text_completion"
}

func (e *Engine) completionBody(p *parsedRequest, out []uint32, u usage, extras pdExtras) map[string]any {
	var text strings.Builder
	for _, t := range out {
		text.WriteString(tokenText(t))
	}
	id, object, _ := e.ids(p)
	choice := map[string]any{"index": 0, "logprobs": nil, "finish_reason": "length", "stop_reason": nil}
	if p.chat {
		choice["message"] = map[string]any{"role": "assistant", "content": text.String(), "tool_calls": []any{}}
	} else {
		choice["text"] = text.String()
		choice["prompt_logprobs"] = nil
	}
	if extras.disaggregatedParams != nil {
		choice["disaggregated_params"] = extras.disaggregatedParams
	}
	body := map[string]any{"id": id, "object": object, "created": e.now().Unix(), "model": e.cfg.Model,
		"choices": []any{choice}, "usage": u}
	if extras.kvTransferParams != nil {
		body["kv_transfer_params"] = extras.kvTransferParams
	}
	return body
}

// stream writes SSE chunks in the OpenAI shape the engines use, one per
// decode step, then the optional usage chunk and "data: [DONE]".
func (e *Engine) stream(w *trackingWriter, r *http.Request, p *parsedRequest, out []uint32, u usage, abort bool) error {
	ctx := r.Context()
	id, _, object := e.ids(p)
	created := e.now().Unix()
	h := w.Header()
	h.Set("Content-Type", "text/event-stream")
	h.Set("Cache-Control", "no-cache")
	w.WriteHeader(http.StatusOK)
	send := func(v any) error {
		b, err := json.Marshal(v)
		if err != nil {
			return fmt.Errorf("encode chunk: %w", err)
		}
		if _, err := fmt.Fprintf(w, "data: %s\n\n", b); err != nil {
			return err
		}
		w.Flush()
		return nil
	}
	chunk := func(choice map[string]any) map[string]any {
		return map[string]any{"id": id, "object": object, "created": created, "model": e.cfg.Model,
			"choices": []any{choice}}
	}
	if p.chat {
		if err := send(chunk(map[string]any{"index": 0, "delta": map[string]any{"role": "assistant", "content": ""},
			"logprobs": nil, "finish_reason": nil})); err != nil {
			return err
		}
	}
	for i, t := range out {
		if abort && i == len(out)/2 {
			return errAbortConn
		}
		if err := e.sleep(ctx, e.decodeStep()); err != nil {
			return err
		}
		var finish any
		if i == len(out)-1 {
			finish = "length"
		}
		c := map[string]any{"index": 0, "logprobs": nil, "finish_reason": finish}
		if p.chat {
			c["delta"] = map[string]any{"content": tokenText(t)}
		} else {
			c["text"] = tokenText(t)
			c["stop_reason"] = nil
		}
		if err := send(chunk(c)); err != nil {
			return err
		}
	}
	if p.StreamOptions != nil && p.StreamOptions.IncludeUsage {
		if err := send(map[string]any{"id": id, "object": object, "created": created, "model": e.cfg.Model,
			"choices": []any{}, "usage": u}); err != nil {
			return err
		}
	}
	if _, err := fmt.Fprint(w, "data: [DONE]\n\n"); err != nil {
		return err
	}
	w.Flush()
	return nil
}
