package enginesim

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"strconv"

	"github.com/prometheus/client_golang/prometheus/promhttp"
)

const maxBody = 64 << 20

// Handler is the engine's HTTP API.
func (e *Engine) Handler() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("POST /v1/completions", e.handleGenerate(false))
	mux.HandleFunc("POST /v1/chat/completions", e.handleGenerate(true))
	mux.HandleFunc("GET /v1/models", e.handleModels)
	mux.HandleFunc("GET /health", e.handleHealth)
	mux.Handle("GET /metrics", promhttp.HandlerFor(e.reg, promhttp.HandlerOpts{}))
	switch e.cfg.Engine {
	case EngineVLLM:
		mux.HandleFunc("POST /tokenize", e.handleTokenize)
	case EngineSGLang:
		mux.HandleFunc("GET /get_server_info", e.handleSGLangServerInfo)
		mux.HandleFunc("GET /server_info", e.handleSGLangServerInfo)
		mux.HandleFunc("POST /generate", e.handleSGLGenerate)
	case EngineTRTLLM:
		mux.HandleFunc("POST /kv_cache_events", e.handleTRTDrain)
		mux.HandleFunc("GET /server_info", e.handleTRTServerInfo)
	}
	mux.HandleFunc("GET /sim/stats", func(w http.ResponseWriter, _ *http.Request) { writeJSON(w, 200, e.Stats()) })
	mux.HandleFunc("GET /sim/cache", func(w http.ResponseWriter, _ *http.Request) { writeJSON(w, 200, e.Cache()) })
	mux.HandleFunc("GET /sim/fault", func(w http.ResponseWriter, _ *http.Request) { writeJSON(w, 200, e.Faults()) })
	mux.HandleFunc("POST /sim/fault", e.handleFault)
	if e.sideLn == nil {
		// Without a separate side channel, transfers are claimed here.
		mux.HandleFunc("POST /sim/pd/claim/{id}", e.handleClaim)
	}
	return mux
}

func (e *Engine) handleHealth(w http.ResponseWriter, _ *http.Request) {
	if e.faults.healthFail() {
		w.WriteHeader(http.StatusServiceUnavailable)
		return
	}
	if e.cfg.Engine == EngineLlamaCpp {
		writeJSON(w, 200, map[string]string{"status": "ok"})
		return
	}
	w.WriteHeader(http.StatusOK)
}

func (e *Engine) handleModels(w http.ResponseWriter, _ *http.Request) {
	owner := map[string]string{EngineVLLM: "vllm", EngineSGLang: "sglang", EngineTRTLLM: "tensorrt_llm", EngineLlamaCpp: "llamacpp"}[e.cfg.Engine]
	data := []any{map[string]any{
		"id": e.cfg.Model, "object": "model", "created": e.now().Unix(), "owned_by": owner,
		"root": e.cfg.Model, "parent": nil, "max_model_len": e.cfg.MaxModelLen}}
	for _, l := range e.loras {
		data = append(data, map[string]any{"id": l.name, "object": "model", "created": e.now().Unix(),
			"owned_by": owner, "root": l.name, "parent": e.cfg.Model, "max_model_len": e.cfg.MaxModelLen})
	}
	writeJSON(w, 200, map[string]any{"object": "list", "data": data})
}

// lora returns the adapter a request's model names, or nil.
func (e *Engine) lora(model string) *loraRef {
	for _, l := range e.loras {
		if l.name == model {
			return l
		}
	}
	return nil
}

func (e *Engine) handleTokenize(w http.ResponseWriter, r *http.Request) {
	body, err := io.ReadAll(io.LimitReader(r.Body, maxBody))
	if err != nil {
		writeError(w, e.cfg.Engine, fmt.Errorf("%w: read body: %v", ErrBadRequest, err))
		return
	}
	var req struct {
		Model    string          `json:"model"`
		Prompt   json.RawMessage `json:"prompt"`
		Messages json.RawMessage `json:"messages"`
	}
	if err := json.Unmarshal(body, &req); err != nil {
		writeError(w, e.cfg.Engine, fmt.Errorf("%w: request body: %v", ErrBadRequest, err))
		return
	}
	path := "/v1/completions"
	if req.Messages != nil {
		path = "/v1/chat/completions"
	} else if req.Prompt == nil {
		writeError(w, e.cfg.Engine, fmt.Errorf("%w: either prompt or messages is required", ErrBadRequest))
		return
	}
	toks, err := e.tokensOf(path, body, req.Prompt, req.Messages != nil)
	if err != nil {
		writeError(w, e.cfg.Engine, err)
		return
	}
	writeJSON(w, 200, map[string]any{"count": len(toks), "max_model_len": e.cfg.MaxModelLen, "tokens": toks})
}

func (e *Engine) handleSGLangServerInfo(w http.ResponseWriter, _ *http.Request) {
	mode := "null"
	if e.cfg.Role != RoleBoth {
		mode = e.cfg.Role
	}
	// SGLang merges its server arguments (max_running_requests is the
	// --max-running-requests the emulator runs as) with one internal state
	// per data-parallel rank carrying the scheduler's effective cap; the
	// emulator's one scheduler shares MaxRunning among the ranks.
	states := make([]map[string]any, e.cfg.DPRanks)
	for i := range states {
		share := e.cfg.MaxRunning / e.cfg.DPRanks
		if i < e.cfg.MaxRunning%e.cfg.DPRanks {
			share++
		}
		states[i] = map[string]any{"effective_max_running_requests_per_dp": share, "last_gen_throughput": 0.0}
	}
	info := map[string]any{
		"model_path": e.cfg.Model, "served_model_name": e.cfg.Model, "page_size": e.cfg.BlockSize,
		"dp_size": e.cfg.DPRanks, "context_length": e.cfg.MaxModelLen, "max_running_requests": e.cfg.MaxRunning,
		"disaggregation_mode": mode, "disaggregation_bootstrap_port": e.BootstrapPort(),
		"internal_states": states, "version": "sim",
	}
	if ports := e.ZMQPorts(); len(ports) > 0 {
		info["kv_events"] = map[string]any{"endpoint": zmqEndpoint(e.cfg.ZMQBind, ports[0], 0),
			"ranks": len(ports), "page_size": e.cfg.BlockSize}
	}
	writeJSON(w, 200, info)
}

func (e *Engine) handleTRTServerInfo(w http.ResponseWriter, _ *http.Request) {
	writeJSON(w, 200, map[string]any{
		"disaggregated_params": map[string]any{"role": e.cfg.Role},
		"kv_cache_hash_algo":   "v1_block_key",
		"tokens_per_block":     e.cfg.BlockSize,
	})
}

func (e *Engine) handleTRTDrain(w http.ResponseWriter, r *http.Request) {
	consumer := r.Header.Get("X-Loxilb-Node")
	if consumer == "" {
		consumer, _, _ = net.SplitHostPort(r.RemoteAddr)
	}
	writeJSON(w, 200, e.trt.drain(consumer))
}

func (e *Engine) handleFault(w http.ResponseWriter, r *http.Request) {
	body, err := io.ReadAll(io.LimitReader(r.Body, 1<<20))
	if err != nil {
		writeError(w, e.cfg.Engine, fmt.Errorf("%w: read body: %v", ErrBadRequest, err))
		return
	}
	var probe FaultRequest
	dec := json.NewDecoder(bytes.NewReader(body))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&probe); err != nil {
		writeError(w, e.cfg.Engine, fmt.Errorf("%w: fault body: %v", ErrBadRequest, err))
		return
	}
	// Apply the named fields over the current (or cleared) faults.
	req := FaultRequest{Faults: e.faults.get()}
	if probe.Clear {
		req.Faults = Faults{}
	}
	if err := json.Unmarshal(body, &req); err != nil {
		writeError(w, e.cfg.Engine, fmt.Errorf("%w: fault body: %v", ErrBadRequest, err))
		return
	}
	if err := e.SetFaults(req.Faults); err != nil {
		writeError(w, e.cfg.Engine, fmt.Errorf("%w: %v", ErrBadRequest, err))
		return
	}
	if req.Restart {
		e.Restart()
	}
	writeJSON(w, 200, e.Faults())
}

// ---- OpenAI request handling ----

type genRequest struct {
	Model               string          `json:"model"`
	Prompt              json.RawMessage `json:"prompt"`
	Messages            json.RawMessage `json:"messages"`
	MaxTokens           *int            `json:"max_tokens"`
	MaxCompletionTokens *int            `json:"max_completion_tokens"`
	Stream              bool            `json:"stream"`
	StreamOptions       *struct {
		IncludeUsage bool `json:"include_usage"`
	} `json:"stream_options"`
	KVTransferParams    map[string]any `json:"kv_transfer_params"`
	BootstrapHost       *string        `json:"bootstrap_host"`
	BootstrapPort       *int           `json:"bootstrap_port"`
	BootstrapRoom       *json.Number   `json:"bootstrap_room"`
	DisaggregatedParams map[string]any `json:"disaggregated_params"`
	CacheSalt           *string        `json:"cache_salt"`
	DataParallelRank    *int           `json:"data_parallel_rank"`
	RoutedDPRank        *int           `json:"routed_dp_rank"`
}

// tokensOf extracts the prompt's token ids: token-id prompts are used
// as they are, text goes through the tokenizer.
func (e *Engine) tokensOf(path string, body []byte, prompt json.RawMessage, chat bool) ([]uint32, error) {
	if !chat {
		if len(prompt) == 0 || string(prompt) == "null" {
			return nil, fmt.Errorf("%w: prompt is required", ErrBadRequest)
		}
		trimmed := bytes.TrimSpace(prompt)
		if trimmed[0] == '[' {
			var ids []int64
			if err := json.Unmarshal(trimmed, &ids); err == nil {
				return checkIDs(ids)
			}
			var nested [][]int64
			if err := json.Unmarshal(trimmed, &nested); err == nil {
				if len(nested) != 1 {
					return nil, fmt.Errorf("%w: batched prompts (%d) are not supported; send one prompt per request", ErrBadRequest, len(nested))
				}
				return checkIDs(nested[0])
			}
			var strs []string
			if err := json.Unmarshal(trimmed, &strs); err != nil || len(strs) != 1 {
				return nil, fmt.Errorf("%w: prompt must be a string, a list of token ids, or a one-element list of either", ErrBadRequest)
			}
			body, _ = json.Marshal(map[string]string{"prompt": strs[0]})
		} else if trimmed[0] != '"' {
			return nil, fmt.Errorf("%w: prompt must be a string or a list of token ids", ErrBadRequest)
		}
	}
	toks, err := e.tok.EncodeRequest(e.cfg.Engine, path, body)
	if err != nil {
		return nil, fmt.Errorf("%w: tokenize: %w", ErrBadRequest, err)
	}
	return toks, nil
}

func checkIDs(ids []int64) ([]uint32, error) {
	out := make([]uint32, len(ids))
	for i, v := range ids {
		if v < 0 || v > 1<<32-1 {
			return nil, fmt.Errorf("%w: prompt token id %d at index %d is out of range", ErrBadRequest, v, i)
		}
		out[i] = uint32(v)
	}
	return out, nil
}

func (e *Engine) handleGenerate(chat bool) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		e.settle(w, r, func(tw *trackingWriter) error { return e.generate(tw, r, chat) })
	}
}

// settle runs one generation handler and settles its outcome the same way
// for every endpoint: counters, the emulated connection abort, and an
// error response only when nothing was written yet.
func (e *Engine) settle(w http.ResponseWriter, r *http.Request, run func(*trackingWriter) error) {
	e.requests.Add(1)
	tw := &trackingWriter{ResponseWriter: w}
	if err := run(tw); err != nil {
		e.failed.Add(1)
		if errors.Is(err, errAbortConn) {
			// Closing the connection without a complete response is
			// the fault being emulated.
			panic(http.ErrAbortHandler)
		}
		e.log.Debug("request failed", "path", r.URL.Path, "err", err)
		if !tw.written {
			writeError(w, e.cfg.Engine, err)
		}
		return
	}
	e.completed.Add(1)
}

// trackingWriter remembers whether a response has started, so an error
// after the first byte is not written as a second response.
type trackingWriter struct {
	http.ResponseWriter
	written bool
}

func (t *trackingWriter) WriteHeader(code int) { t.written = true; t.ResponseWriter.WriteHeader(code) }
func (t *trackingWriter) Write(b []byte) (int, error) {
	t.written = true
	return t.ResponseWriter.Write(b)
}
func (t *trackingWriter) Flush() {
	if f, ok := t.ResponseWriter.(http.Flusher); ok {
		f.Flush()
	}
}

// parsedRequest is a validated generation request.
type parsedRequest struct {
	genRequest
	path      string
	chat      bool
	tokens    []uint32
	maxTokens int
	requestID string
}

func (e *Engine) parse(r *http.Request, chat bool) (*parsedRequest, error) {
	body, err := io.ReadAll(io.LimitReader(r.Body, maxBody))
	if err != nil {
		return nil, fmt.Errorf("%w: read body: %v", ErrBadRequest, err)
	}
	p := &parsedRequest{path: r.URL.Path, chat: chat}
	dec := json.NewDecoder(bytes.NewReader(body))
	dec.UseNumber()
	if err := dec.Decode(&p.genRequest); err != nil {
		return nil, fmt.Errorf("%w: request body is not valid JSON for this endpoint: %v", ErrBadRequest, err)
	}
	if e.cfg.Engine == EngineVLLM && p.Model != "" && p.Model != e.cfg.Model && e.lora(p.Model) == nil {
		return nil, fmt.Errorf("%w: The model `%s` does not exist.", ErrModelNotFound, p.Model)
	}
	if p.CacheSalt != nil && *p.CacheSalt == "" {
		return nil, fmt.Errorf("%w: Parameter 'cache_salt' must be a non-empty string if provided.", ErrBadRequest)
	}
	if chat && (len(p.Messages) == 0 || string(p.Messages) == "null") {
		return nil, fmt.Errorf("%w: messages is required", ErrBadRequest)
	}
	p.tokens, err = e.tokensOf(p.path, body, p.Prompt, chat)
	if err != nil {
		return nil, err
	}
	if len(p.tokens) == 0 {
		return nil, fmt.Errorf("%w: the prompt cannot be empty", ErrBadRequest)
	}
	p.maxTokens = 16
	if p.MaxTokens != nil {
		p.maxTokens = *p.MaxTokens
	}
	if p.MaxCompletionTokens != nil {
		p.maxTokens = *p.MaxCompletionTokens
	}
	if p.maxTokens < 1 {
		return nil, fmt.Errorf("%w: max_tokens must be at least 1, got %d", ErrBadRequest, p.maxTokens)
	}
	if n := len(p.tokens) + p.maxTokens; n > e.cfg.MaxModelLen {
		return nil, fmt.Errorf("%w: This model's maximum context length is %d tokens. However, you requested %d tokens (%d in the messages, %d in the completion). Please reduce the length of the messages or completion.",
			ErrBadRequest, e.cfg.MaxModelLen, n, len(p.tokens), p.maxTokens)
	}
	p.requestID = r.Header.Get("X-Request-Id")
	if p.requestID == "" {
		p.requestID = fmt.Sprintf("%x-%d", e.started.UnixNano(), e.reqSeq.Add(1))
	}
	return p, nil
}

// pickRank is the engine's data-parallel balancer: round robin, unless
// the request names a rank the way this engine reads one. SGLang reads
// routed_dp_rank, then its older alias data_parallel_rank, from the body;
// vLLM reads only the X-data-parallel-rank header (a malformed value is
// ignored, as vLLM does).
func (e *Engine) pickRank(r *http.Request, p *parsedRequest) (*rank, error) {
	var want *int
	switch e.cfg.Engine {
	case EngineSGLang:
		switch {
		case p.RoutedDPRank != nil:
			want = p.RoutedDPRank
		case p.DataParallelRank != nil:
			want = p.DataParallelRank
		}
	case EngineVLLM:
		if v := r.Header.Get("X-data-parallel-rank"); v != "" {
			if n, err := strconv.Atoi(v); err == nil {
				want = &n
			}
		}
	}
	if want != nil {
		if *want < 0 || *want >= len(e.ranks) {
			return nil, fmt.Errorf("%w: data parallel rank %d out of range [0, %d)", ErrBadRequest, *want, len(e.ranks))
		}
		rk := e.ranks[*want]
		rk.served.Add(1)
		rk.targeted.Add(1)
		return rk, nil
	}
	rk := e.ranks[int(e.rr.Add(1)-1)%len(e.ranks)]
	rk.served.Add(1)
	return rk, nil
}
