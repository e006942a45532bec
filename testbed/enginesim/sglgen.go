package enginesim

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
	"sync"
)

// SGLang's native generation API, POST /generate (SGLang only). The body
// names the prompt as "text" (a string, or a list of strings for a batch)
// or "input_ids" (a list of token ids, or a list of such lists); the two
// exclude each other. In P/D mode each prompt carries bootstrap_host,
// bootstrap_port and bootstrap_room; in a batch each of the three is a
// list with one entry per prompt, and the rooms must be distinct (a room
// names one KV transfer). The answer is {"text", "output_ids",
// "meta_info"} per prompt: one object, or a list for a batch; streamed,
// SSE chunks carry the text so far (one per prompt and step, with
// "index") and end with "data: [DONE]".

// sglDefaultMaxNewTokens is SGLang's sampling_params.max_new_tokens default.
const sglDefaultMaxNewTokens = 128

type sglGenerateRequest struct {
	Text           json.RawMessage `json:"text"`
	InputIDs       json.RawMessage `json:"input_ids"`
	SamplingParams struct {
		MaxNewTokens *int `json:"max_new_tokens"`
	} `json:"sampling_params"`
	Stream           bool            `json:"stream"`
	RID              json.RawMessage `json:"rid"`
	BootstrapHost    json.RawMessage `json:"bootstrap_host"`
	BootstrapPort    json.RawMessage `json:"bootstrap_port"`
	BootstrapRoom    json.RawMessage `json:"bootstrap_room"`
	RoutedDPRank     *int            `json:"routed_dp_rank"`
	DataParallelRank *int            `json:"data_parallel_rank"`
}

func (e *Engine) handleSGLGenerate(w http.ResponseWriter, r *http.Request) {
	e.settle(w, r, func(tw *trackingWriter) error { return e.sglGenerate(tw, r) })
}

func (e *Engine) sglGenerate(w *trackingWriter, r *http.Request) error {
	if err := e.requestFaults(w, r); err != nil {
		return err
	}
	ps, batch, err := e.parseSGLGenerate(r)
	if err != nil {
		return err
	}
	// The prompts of a batch run at once, as the engine schedules them:
	// a decode leg waits for its own room's prefill.
	res := make([]served, len(ps))
	errs := make([]error, len(ps))
	var wg sync.WaitGroup
	for i, p := range ps {
		wg.Add(1)
		go func() {
			defer wg.Done()
			res[i], errs[i] = e.serve(r.Context(), r, p)
		}()
	}
	wg.Wait()
	var first error
	for i, err := range errs {
		if err == nil {
			defer res[i].done()
		} else if first == nil {
			first = err
		}
	}
	if first != nil {
		return first
	}
	prefillOnly := res[0].plan.prefillOnly
	if ps[0].Stream && !prefillOnly {
		return e.sglStream(w, r, ps, res)
	}
	if err := e.sleep(r.Context(), e.decodeTime(len(res[0].out))); err != nil {
		return err
	}
	if !batch {
		writeJSON(w, 200, sglResult(ps[0], res[0].out, res[0]))
		return nil
	}
	out := make([]any, len(ps))
	for i := range ps {
		out[i] = sglResult(ps[i], res[i].out, res[i])
	}
	writeJSON(w, 200, out)
	return nil
}

// sglResult is one prompt's answer with the first n output tokens.
func sglResult(p *parsedRequest, out []uint32, s served) map[string]any {
	var text strings.Builder
	for _, t := range out {
		text.WriteString(tokenText(t))
	}
	var finish any
	if len(out) == len(s.out) {
		finish = map[string]any{"type": "length", "length": len(out)}
	}
	return map[string]any{"text": text.String(), "output_ids": out, "meta_info": map[string]any{
		"id": p.requestID, "finish_reason": finish, "prompt_tokens": s.u.PromptTokens,
		"completion_tokens": len(out), "cached_tokens": s.u.PromptTokensDetails.CachedTokens}}
}

func (e *Engine) sglStream(w *trackingWriter, r *http.Request, ps []*parsedRequest, res []served) error {
	h := w.Header()
	h.Set("Content-Type", "text/event-stream")
	h.Set("Cache-Control", "no-cache")
	w.WriteHeader(http.StatusOK)
	abort := e.faults.takeCloseMidStream()
	steps := len(res[0].out)
	for step := 1; step <= steps; step++ {
		if abort && step == steps/2+1 {
			return errAbortConn
		}
		if err := e.sleep(r.Context(), e.decodeStep()); err != nil {
			return err
		}
		for i, p := range ps {
			c := sglResult(p, res[i].out[:step], res[i])
			c["index"] = i
			b, _ := json.Marshal(c)
			if _, err := fmt.Fprintf(w, "data: %s\n\n", b); err != nil {
				return err
			}
		}
		w.Flush()
	}
	if _, err := fmt.Fprint(w, "data: [DONE]\n\n"); err != nil {
		return err
	}
	w.Flush()
	return nil
}

// parseSGLGenerate validates a /generate body and splits it into one
// request per prompt, each with its own bootstrap fields.
func (e *Engine) parseSGLGenerate(r *http.Request) ([]*parsedRequest, bool, error) {
	body, err := io.ReadAll(io.LimitReader(r.Body, maxBody))
	if err != nil {
		return nil, false, fmt.Errorf("%w: read body: %v", ErrBadRequest, err)
	}
	var req sglGenerateRequest
	dec := json.NewDecoder(bytes.NewReader(body))
	dec.UseNumber()
	if err := dec.Decode(&req); err != nil {
		return nil, false, fmt.Errorf("%w: request body is not valid JSON for /generate: %v", ErrBadRequest, err)
	}
	prompts, batch, err := e.sglPrompts(req)
	if err != nil {
		return nil, false, err
	}
	n := len(prompts)
	hosts, err := sglPerPrompt[string](req.BootstrapHost, "bootstrap_host", batch, n)
	if err != nil {
		return nil, false, err
	}
	ports, err := sglPerPrompt[int](req.BootstrapPort, "bootstrap_port", batch, n)
	if err != nil {
		return nil, false, err
	}
	rooms, err := sglPerPrompt[json.Number](req.BootstrapRoom, "bootstrap_room", batch, n)
	if err != nil {
		return nil, false, err
	}
	if rooms != nil {
		seen := make(map[string]int, n)
		for i, rm := range rooms {
			if j, dup := seen[rm.String()]; dup {
				return nil, false, fmt.Errorf("%w: bootstrap_room %s is given to prompts %d and %d; each prompt needs its own room", ErrBadRequest, rm, j, i)
			}
			seen[rm.String()] = i
		}
	}
	maxTokens := sglDefaultMaxNewTokens
	if m := req.SamplingParams.MaxNewTokens; m != nil {
		maxTokens = *m
	}
	if maxTokens < 1 {
		return nil, false, fmt.Errorf("%w: sampling_params.max_new_tokens must be at least 1, got %d", ErrBadRequest, maxTokens)
	}
	rid := r.Header.Get("X-Request-Id")
	if rid == "" {
		rid = fmt.Sprintf("%x-%d", e.started.UnixNano(), e.reqSeq.Add(1))
	}
	out := make([]*parsedRequest, n)
	for i, toks := range prompts {
		if k := len(toks) + maxTokens; k > e.cfg.MaxModelLen {
			return nil, false, fmt.Errorf("%w: prompt %d: %d tokens plus max_new_tokens %d exceed the context length %d", ErrBadRequest, i, len(toks), maxTokens, e.cfg.MaxModelLen)
		}
		p := &parsedRequest{path: r.URL.Path, tokens: toks, maxTokens: maxTokens, requestID: rid}
		if batch {
			p.requestID = rid + "-" + strconv.Itoa(i)
		}
		p.Stream, p.RoutedDPRank, p.DataParallelRank = req.Stream, req.RoutedDPRank, req.DataParallelRank
		if hosts != nil {
			p.BootstrapHost = &hosts[i]
		}
		if ports != nil {
			p.BootstrapPort = &ports[i]
		}
		if rooms != nil {
			p.BootstrapRoom = &rooms[i]
		}
		out[i] = p
	}
	return out, batch, nil
}

// sglPrompts returns each prompt's token ids and whether the body is a batch.
func (e *Engine) sglPrompts(req sglGenerateRequest) ([][]uint32, bool, error) {
	hasText, hasIDs := present(req.Text), present(req.InputIDs)
	if hasText == hasIDs {
		return nil, false, fmt.Errorf("%w: either text or input_ids should be provided, not both and not neither", ErrBadRequest)
	}
	if hasText {
		var one string
		if json.Unmarshal(req.Text, &one) == nil {
			toks, err := e.sglEncode(one, 0)
			return [][]uint32{toks}, false, err
		}
		var many []string
		if err := json.Unmarshal(req.Text, &many); err != nil {
			return nil, false, fmt.Errorf("%w: text must be a string or a list of strings", ErrBadRequest)
		}
		if len(many) == 0 {
			return nil, false, fmt.Errorf("%w: text is an empty list", ErrBadRequest)
		}
		out := make([][]uint32, len(many))
		for i, s := range many {
			toks, err := e.sglEncode(s, i)
			if err != nil {
				return nil, false, err
			}
			out[i] = toks
		}
		return out, true, nil
	}
	var one []int64
	if json.Unmarshal(req.InputIDs, &one) == nil {
		toks, err := sglIDs(one, 0)
		return [][]uint32{toks}, false, err
	}
	var many [][]int64
	if err := json.Unmarshal(req.InputIDs, &many); err != nil {
		return nil, false, fmt.Errorf("%w: input_ids must be a list of token ids or a list of such lists", ErrBadRequest)
	}
	if len(many) == 0 {
		return nil, false, fmt.Errorf("%w: input_ids is an empty list", ErrBadRequest)
	}
	out := make([][]uint32, len(many))
	for i, ids := range many {
		toks, err := sglIDs(ids, i)
		if err != nil {
			return nil, false, err
		}
		out[i] = toks
	}
	return out, true, nil
}

// sglEncode tokenizes text as SGLang's tokenizer manager does for
// /generate, the same way as a /v1/completions prompt.
func (e *Engine) sglEncode(text string, i int) ([]uint32, error) {
	body, _ := json.Marshal(map[string]string{"prompt": text})
	toks, err := e.tok.EncodeRequest(e.cfg.Engine, "/v1/completions", body)
	if err != nil {
		return nil, fmt.Errorf("%w: prompt %d: tokenize: %w", ErrBadRequest, i, err)
	}
	if len(toks) == 0 {
		return nil, fmt.Errorf("%w: prompt %d is empty", ErrBadRequest, i)
	}
	return toks, nil
}

func sglIDs(ids []int64, i int) ([]uint32, error) {
	if len(ids) == 0 {
		return nil, fmt.Errorf("%w: prompt %d has no input_ids", ErrBadRequest, i)
	}
	toks, err := checkIDs(ids)
	if err != nil {
		return nil, fmt.Errorf("prompt %d: %w", i, err)
	}
	return toks, nil
}

// sglPerPrompt reads one bootstrap field: absent gives nil; a single
// prompt takes a scalar; a batch of n prompts takes a list of n entries,
// one per prompt.
func sglPerPrompt[T any](v json.RawMessage, name string, batch bool, n int) ([]T, error) {
	if !present(v) {
		return nil, nil
	}
	dec := func(b []byte, out any) error {
		d := json.NewDecoder(bytes.NewReader(b))
		d.UseNumber()
		return d.Decode(out)
	}
	if !batch {
		var one T
		if err := dec(v, &one); err != nil {
			return nil, fmt.Errorf("%w: %s must be a single value for a single prompt, got %s", ErrBadRequest, name, clip(v))
		}
		return []T{one}, nil
	}
	var list []T
	if err := dec(v, &list); err != nil {
		return nil, fmt.Errorf("%w: %s must be a list with one entry per prompt in a batched request (%d prompts), got %s", ErrBadRequest, name, n, clip(v))
	}
	if len(list) != n {
		return nil, fmt.Errorf("%w: %s has %d entries for %d prompts; a batched request needs one per prompt", ErrBadRequest, name, len(list), n)
	}
	return list, nil
}

func present(v json.RawMessage) bool {
	t := bytes.TrimSpace(v)
	return len(t) > 0 && string(t) != "null"
}

func clip(v json.RawMessage) string {
	if len(v) > 64 {
		return string(v[:64]) + "..."
	}
	return string(v)
}
