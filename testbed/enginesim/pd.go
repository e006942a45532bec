package enginesim

import (
	"context"
	"crypto/sha256"
	"encoding/base64"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"strconv"
	"sync"
	"time"
)

// Prefill/decode disaggregation. A prefill leg leaves a transfer record on
// its engine, keyed by the request id (vLLM), the context request id
// (TensorRT-LLM) or the bootstrap room (SGLang). The decode leg claims the
// record over HTTP from the prefill engine named in its parameters, which
// proves the prefill happened and was for the same prompt; a record can be
// claimed once. These sim-only endpoints stand in for the NIXL side channel,
// the SGLang bootstrap server and the TensorRT-LLM transceiver:
//
//	POST /sim/pd/claim/{id}            vLLM and TensorRT-LLM, on the prefill's HTTP port
//	GET  /sim/bootstrap/{room}?wait_ms=N  SGLang, on the prefill's bootstrap port; waits for the leg

type pdKind int

const (
	pdNone pdKind = iota
	pdVLLMPrefill
	pdVLLMDecode
	pdSGLangPrefill
	pdSGLangDecode
	pdTRTContext
	pdTRTGeneration
)

type pdPlan struct {
	kind            pdKind
	key             string // record key for prefill legs
	prefillOnly     bool
	remotePrefilled bool
}

type pdExtras struct {
	kvTransferParams    map[string]any
	disaggregatedParams map[string]any
}

// transferRecord is what a prefill leg leaves for its decode leg.
type transferRecord struct {
	PromptDigest string `json:"prompt_digest"`
	NumTokens    int    `json:"num_tokens"`
	Model        string `json:"model"`
	Blocks       int    `json:"blocks"`
}

func promptDigest(tokens []uint32) string {
	h := sha256.New()
	var b [4]byte
	for _, t := range tokens {
		binary.LittleEndian.PutUint32(b[:], t)
		h.Write(b[:])
	}
	return hex.EncodeToString(h.Sum(nil))
}

// pdStore holds transfer records. Waiters (SGLang decode legs) may arrive
// before the record; entries expire after pdTTL.
type pdStore struct {
	mu      sync.Mutex
	entries map[string]*pdEntry
	done    chan struct{}
	once    sync.Once
}

type pdEntry struct {
	rec     transferRecord
	ready   chan struct{}
	set     bool
	created time.Time
}

const pdTTL = 5 * time.Minute

func newPDStore() *pdStore {
	return &pdStore{entries: make(map[string]*pdEntry), done: make(chan struct{})}
}

func (s *pdStore) close() { s.once.Do(func() { close(s.done) }) }

func (s *pdStore) entryLocked(key string) *pdEntry {
	now := time.Now()
	for k, en := range s.entries {
		if now.Sub(en.created) > pdTTL {
			delete(s.entries, k)
		}
	}
	en, ok := s.entries[key]
	if !ok {
		en = &pdEntry{ready: make(chan struct{}), created: now}
		s.entries[key] = en
	}
	return en
}

func (s *pdStore) put(key string, rec transferRecord) {
	s.mu.Lock()
	defer s.mu.Unlock()
	en := s.entryLocked(key)
	en.rec = rec
	if !en.set {
		en.set = true
		close(en.ready)
	}
}

// claim waits up to wait for the record and removes it.
func (s *pdStore) claim(ctx context.Context, key string, wait time.Duration) (transferRecord, bool) {
	s.mu.Lock()
	en := s.entryLocked(key)
	s.mu.Unlock()
	if wait > 0 {
		t := time.NewTimer(wait)
		defer t.Stop()
		select {
		case <-en.ready:
		case <-t.C:
		case <-ctx.Done():
		case <-s.done:
		}
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if !en.set {
		if wait == 0 || ctx.Err() == nil {
			// Leave waiter-created entries for a prefill that may still
			// come only while someone waits; otherwise drop them.
			if cur, ok := s.entries[key]; ok && cur == en {
				delete(s.entries, key)
			}
		}
		return transferRecord{}, false
	}
	if cur, ok := s.entries[key]; ok && cur == en {
		delete(s.entries, key)
	}
	return en.rec, true
}

func (e *Engine) handleClaim(w http.ResponseWriter, r *http.Request) {
	id := r.PathValue("id")
	rec, ok := e.pd.claim(r.Context(), id, 0)
	if !ok {
		writeError(w, e.cfg.Engine, fmt.Errorf("%w: no prefill transfer %q on this engine", ErrNotFound, id))
		return
	}
	e.claimed.Add(1)
	writeJSON(w, 200, rec)
}

// bootstrapHandler serves the SGLang prefill bootstrap port.
func (e *Engine) bootstrapHandler() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("GET /sim/bootstrap/{room}", func(w http.ResponseWriter, r *http.Request) {
		wait := e.cfg.PDTimeout
		if ms := r.URL.Query().Get("wait_ms"); ms != "" {
			n, err := strconv.Atoi(ms)
			if err != nil || n < 0 {
				writeError(w, e.cfg.Engine, fmt.Errorf("%w: wait_ms %q", ErrBadRequest, ms))
				return
			}
			wait = time.Duration(n) * time.Millisecond
		}
		room := r.PathValue("room")
		rec, ok := e.pd.claim(r.Context(), "room:"+room, wait)
		if !ok {
			writeError(w, e.cfg.Engine, fmt.Errorf("%w: no prefill for bootstrap_room %s", ErrNotFound, room))
			return
		}
		e.claimed.Add(1)
		writeJSON(w, 200, rec)
	})
	mux.HandleFunc("GET /health", func(w http.ResponseWriter, _ *http.Request) { w.WriteHeader(200) })
	return mux
}

func boolParam(m map[string]any, k string) bool {
	b, _ := m[k].(bool)
	return b
}

func stringParam(m map[string]any, k string) string {
	switch v := m[k].(type) {
	case string:
		return v
	case json.Number:
		return v.String()
	}
	return ""
}

// pdBefore validates the P/D parameters of a request and, for a decode leg,
// claims the transfer record of its prefill leg before admission.
func (e *Engine) pdBefore(ctx context.Context, p *parsedRequest) (pdPlan, error) {
	switch e.cfg.Engine {
	case EngineVLLM:
		kvp := p.KVTransferParams
		switch {
		case kvp != nil && boolParam(kvp, "do_remote_prefill"):
			if e.cfg.Role == RolePrefill {
				return pdPlan{}, fmt.Errorf("%w: prefill-only engine got a decode leg (do_remote_prefill)", ErrBadRequest)
			}
			host, port := stringParam(kvp, "remote_host"), stringParam(kvp, "remote_port")
			id := stringParam(kvp, "remote_request_id")
			if id == "" {
				id = p.requestID
			}
			if host == "" || port == "" {
				return pdPlan{}, fmt.Errorf("%w: kv_transfer_params lacks remote_host/remote_port", ErrNoPrefill)
			}
			if err := e.claimRemote(ctx, "http://"+net.JoinHostPort(host, port)+"/sim/pd/claim/"+url.PathEscape(id), p); err != nil {
				return pdPlan{}, err
			}
			return pdPlan{kind: pdVLLMDecode, remotePrefilled: true}, nil
		case kvp != nil && boolParam(kvp, "do_remote_decode"):
			if e.cfg.Role == RoleDecode {
				return pdPlan{}, fmt.Errorf("%w: decode-only engine got a prefill leg (do_remote_decode)", ErrBadRequest)
			}
			return pdPlan{kind: pdVLLMPrefill, key: p.requestID, prefillOnly: true}, nil
		case e.cfg.Role == RoleDecode:
			return pdPlan{}, fmt.Errorf("%w: decode-only engine needs kv_transfer_params with do_remote_prefill from a prefill leg", ErrNoPrefill)
		}
	case EngineSGLang:
		switch e.cfg.Role {
		case RolePrefill:
			if p.BootstrapRoom == nil {
				return pdPlan{}, fmt.Errorf("%w: disaggregation prefill needs bootstrap_room", ErrBadRequest)
			}
			room, err := roomOf(p.BootstrapRoom)
			if err != nil {
				return pdPlan{}, err
			}
			return pdPlan{kind: pdSGLangPrefill, key: "room:" + room, prefillOnly: true}, nil
		case RoleDecode:
			if p.BootstrapRoom == nil || p.BootstrapHost == nil || p.BootstrapPort == nil {
				return pdPlan{}, fmt.Errorf("%w: disaggregation decode needs bootstrap_host, bootstrap_port and bootstrap_room", ErrNoPrefill)
			}
			room, err := roomOf(p.BootstrapRoom)
			if err != nil {
				return pdPlan{}, err
			}
			u := fmt.Sprintf("http://%s/sim/bootstrap/%s?wait_ms=%d",
				net.JoinHostPort(*p.BootstrapHost, strconv.Itoa(*p.BootstrapPort)), room, e.cfg.PDTimeout.Milliseconds())
			if err := e.fetchRemote(ctx, http.MethodGet, u, p); err != nil {
				return pdPlan{}, err
			}
			return pdPlan{kind: pdSGLangDecode, remotePrefilled: true}, nil
		}
	case EngineTRTLLM:
		dp := p.DisaggregatedParams
		rt := ""
		if dp != nil {
			rt = stringParam(dp, "request_type")
		}
		switch rt {
		case "context_only":
			if e.cfg.Role == RoleDecode {
				return pdPlan{}, fmt.Errorf("%w: generation server got a context_only request", ErrBadRequest)
			}
			id := e.ctxReqID.Add(1)
			return pdPlan{kind: pdTRTContext, key: "ctx:" + strconv.FormatUint(id, 10), prefillOnly: true}, nil
		case "generation_only":
			if e.cfg.Role == RolePrefill {
				return pdPlan{}, fmt.Errorf("%w: context server got a generation_only request", ErrBadRequest)
			}
			var st opaqueState
			raw, err := base64.StdEncoding.DecodeString(stringParam(dp, "encoded_opaque_state"))
			if err == nil {
				err = json.Unmarshal(raw, &st)
			}
			if err != nil || st.Host == "" || st.Port == 0 {
				return pdPlan{}, fmt.Errorf("%w: disaggregated_params.encoded_opaque_state does not name a context server", ErrNoPrefill)
			}
			id := stringParam(dp, "ctx_request_id")
			if id == "" {
				return pdPlan{}, fmt.Errorf("%w: disaggregated_params.ctx_request_id is required", ErrNoPrefill)
			}
			u := "http://" + net.JoinHostPort(st.Host, strconv.Itoa(st.Port)) + "/sim/pd/claim/" + url.PathEscape("ctx:"+id)
			if err := e.claimRemote(ctx, u, p); err != nil {
				return pdPlan{}, err
			}
			return pdPlan{kind: pdTRTGeneration, remotePrefilled: true}, nil
		case "", "context_and_generation":
			if e.cfg.Role == RoleDecode {
				return pdPlan{}, fmt.Errorf("%w: generation server needs disaggregated_params with request_type generation_only", ErrNoPrefill)
			}
		default:
			return pdPlan{}, fmt.Errorf("%w: disaggregated_params.request_type %q", ErrBadRequest, rt)
		}
	}
	return pdPlan{}, nil
}

type opaqueState struct {
	Host string `json:"host"`
	Port int    `json:"port"`
}

func roomOf(n *json.Number) (string, error) {
	v, err := strconv.ParseUint(n.String(), 10, 64)
	if err != nil || v > 1<<63-1 {
		return "", fmt.Errorf("%w: bootstrap_room %q must be an integer in [0, 2^63-1]", ErrBadRequest, n.String())
	}
	return strconv.FormatUint(v, 10), nil
}

func (e *Engine) claimRemote(ctx context.Context, u string, p *parsedRequest) error {
	return e.fetchRemote(ctx, http.MethodPost, u, p)
}

// fetchRemote claims a transfer record from the prefill engine and checks it
// belongs to the same prompt.
func (e *Engine) fetchRemote(ctx context.Context, method, u string, p *parsedRequest) error {
	req, err := http.NewRequestWithContext(ctx, method, u, nil)
	if err != nil {
		return fmt.Errorf("%w: prefill address: %v", ErrNoPrefill, err)
	}
	resp, err := e.client.Do(req)
	if err != nil {
		return fmt.Errorf("%w: reach prefill engine: %v", ErrNoPrefill, err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("%w: prefill engine at %s answered %d: %s", ErrNoPrefill, req.URL.Host, resp.StatusCode, body)
	}
	var rec transferRecord
	if err := json.Unmarshal(body, &rec); err != nil {
		return fmt.Errorf("%w: prefill engine transfer record: %v", ErrNoPrefill, err)
	}
	if rec.PromptDigest != promptDigest(p.tokens) {
		return fmt.Errorf("%w: the prefill leg was for a different prompt (%d tokens, this one has %d)", ErrNoPrefill, rec.NumTokens, len(p.tokens))
	}
	return nil
}

// pdAfter records a finished prefill leg and builds the parameters its
// response carries.
func (e *Engine) pdAfter(p *parsedRequest, plan pdPlan) pdExtras {
	if !plan.prefillOnly {
		return pdExtras{}
	}
	nblocks := len(p.tokens) / e.cfg.BlockSize
	e.pd.put(plan.key, transferRecord{PromptDigest: promptDigest(p.tokens), NumTokens: len(p.tokens),
		Model: e.cfg.Model, Blocks: nblocks})
	e.transfers.Add(1)
	port := tcpPort(e.ln.Addr())
	switch plan.kind {
	case pdVLLMPrefill:
		if e.sideLn != nil {
			port = tcpPort(e.sideLn.Addr())
		}
		ids := make([]int, nblocks)
		for i := range ids {
			ids[i] = i
		}
		return pdExtras{kvTransferParams: map[string]any{
			"do_remote_prefill": true, "do_remote_decode": false, "remote_block_ids": ids,
			"remote_engine_id": e.engineID, "remote_request_id": p.requestID,
			"remote_host": e.advertiseHost, "remote_port": port, "tp_size": 1}}
	case pdTRTContext:
		st, _ := json.Marshal(opaqueState{Host: e.advertiseHost, Port: port})
		id, _ := strconv.ParseUint(plan.key[len("ctx:"):], 10, 64)
		return pdExtras{disaggregatedParams: map[string]any{
			"request_type": "context_only", "first_gen_tokens": outputTokens(p.tokens, 1),
			"ctx_request_id": id, "encoded_opaque_state": base64.StdEncoding.EncodeToString(st),
			"draft_tokens": nil}}
	}
	return pdExtras{}
}
