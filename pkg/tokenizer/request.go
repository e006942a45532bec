package tokenizer

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"strings"

	"github.com/ardanlabs/jinja"

	"github.com/loxilb-llm/loxilb/pkg/engine"
)

// Engine names accepted by EncodeRequest, as pkg/engine spells them.
const (
	EngineVLLM     = string(engine.VLLM)
	EngineSGLang   = string(engine.SGLang)
	EngineTRTLLM   = string(engine.TRTLLM)
	EngineLlamaCPP = string(engine.LlamaCpp)
)

// Request kinds.
const (
	KindCompletions = "completions"
	KindChat        = "chat"
)

// API paths EncodeRequest understands.
const (
	PathCompletions     = "/v1/completions"
	PathChatCompletions = "/v1/chat/completions"
)

// Sentinel errors of EncodeRequest; the returned errors wrap them with
// detail. Callers map them to HTTP statuses with errors.Is.
var (
	ErrUnknownEngine   = errors.New("unknown engine")
	ErrUnsupportedPath = errors.New("unsupported request path")
	ErrBadRequest      = errors.New("malformed request body")
	// ErrPromptTooLong: the prompt is longer than RequestOptions allows;
	// it was not tokenized past the bound.
	ErrPromptTooLong = errors.New("prompt too long")
)

// RequestTokens is a request's prompt as the engine will see it.
type RequestTokens struct {
	// IDs are the prompt token ids, exactly as the engine computes them.
	IDs []uint32
	// Model is the request's "model" field.
	Model string
	// Kind is KindCompletions or KindChat.
	Kind string
	// Prompts is the number of prompts in a batched /v1/completions
	// request; IDs are those of the first one (the engines run each prompt
	// as its own sequence, and the first is what this request's routing
	// keys on).
	Prompts int
	// Rendered is the chat template output (chat requests only).
	Rendered string
	// Unhashable is non-empty when the engine's block hashes for this
	// request include more than the token ids (LoRA adapter, cache_salt,
	// multimodal inputs, prompt embeddings, a request-supplied template).
	// IDs are still filled in when they could be computed, but they must
	// not be hashed as a plain request.
	Unhashable string
}

// RequestOptions are per-deployment quirks of how an engine renders
// prompts (model profile settings).
type RequestOptions struct {
	// CompletionsBOS makes SGLang /v1/completions prompts BOS + text
	// encoded without the post-processor, unconditionally (a profile quirk
	// some SGLang deployments need). Ignored for other engines.
	CompletionsBOS bool
	// MaxPromptBytes bounds the prompt text that is tokenized: a
	// /v1/completions prompt string or the rendered chat. A longer one is
	// rejected with ErrPromptTooLong before any BPE work. 0: no bound.
	MaxPromptBytes int
	// MaxPromptTokens bounds the prompt's token count: encoding stops
	// with ErrPromptTooLong once it is passed, and a token-id prompt
	// longer than it is rejected. 0: no bound.
	MaxPromptTokens int
	// IDs, when its capacity fits the prompt, is the array an encoded
	// prompt's ids are written to instead of a new one (~11 KB for a
	// 2k-token chat, per request), so a caller that is done with them
	// before its next request can reuse it. The returned IDs may share
	// it: it must not be reused while they are in use.
	IDs []uint32
}

// EncodeRequest returns the prompt token ids of an OpenAI-style request
// body for the given engine, as that engine computes them:
//
//   - /v1/completions: a prompt string is encoded with the tokenizer's
//     post-processor (add_special_tokens=true; vLLM and TRT-LLM honour a
//     request "add_special_tokens"); token ids are used as given; for a
//     list of prompts the first one is used and Prompts says how many.
//   - /v1/chat/completions: messages are rendered with the chat template
//     (add_generation_prompt defaults to true; tools, documents,
//     chat_template_kwargs and continue_final_message are honoured; request
//     values keep their key order), then encoded without adding special
//     tokens again (vLLM and TRT-LLM honour "add_special_tokens").
//
// vLLM and TRT-LLM apply truncate_prompt_tokens (keep the last k tokens).
// Content parts are flattened for templates that expect string content:
// text parts joined with "\n" (vLLM, TRT-LLM, llama.cpp) or " " (SGLang).
func (t *Tokenizer) EncodeRequest(engine, path string, body []byte) (RequestTokens, error) {
	return t.EncodeRequestWith(engine, path, body, RequestOptions{})
}

// RequestFields are the fields of both request kinds that affect the
// prompt or the routing key. Raw fields are spans of the body they were
// read from (ParseRequest).
type RequestFields struct {
	Model                string          `json:"model"`
	Prompt               json.RawMessage `json:"prompt"`
	Messages             json.RawMessage `json:"messages"`
	AddSpecialTokens     *bool           `json:"add_special_tokens"`
	AddGenerationPrompt  *bool           `json:"add_generation_prompt"`
	ContinueFinalMessage bool            `json:"continue_final_message"`
	Tools                json.RawMessage `json:"tools"`
	Documents            json.RawMessage `json:"documents"`
	ChatTemplate         json.RawMessage `json:"chat_template"`
	ChatTemplateKwargs   json.RawMessage `json:"chat_template_kwargs"`
	CacheSalt            json.RawMessage `json:"cache_salt"`
	PromptEmbeds         json.RawMessage `json:"prompt_embeds"`
	LoRAPath             json.RawMessage `json:"lora_path"`
	LoRAName             json.RawMessage `json:"lora_name"`
	LoRARequest          json.RawMessage `json:"lora_request"`
	MultiModalData       json.RawMessage `json:"multi_modal_data"`
	ImageData            json.RawMessage `json:"image_data"`
	TruncatePromptTokens *int64          `json:"truncate_prompt_tokens"`
}

// Request is an OpenAI-style request body read once (ParseRequest). The
// gateway keys its hashing selectors on its fields and encodes the prompt
// from it (EncodeParsed), so no stage decodes the body again.
type Request struct {
	// Fields hold what both stages read; they alias the parsed body.
	Fields RequestFields
	// typeErr is a prompt field of the wrong type (say a numeric
	// "model"): EncodeParsed refuses such a request, while the routing key,
	// which never read those fields, still may use the others.
	typeErr error
}

// ParseRequest reads a request body once. It fails, wrapping ErrBadRequest,
// when the body is not one JSON object. The body must not change while the
// Request is used.
func ParseRequest(body []byte) (*Request, error) {
	trimmed := trimJSONSpace(body)
	if len(trimmed) == 0 || trimmed[0] != '{' {
		return nil, fmt.Errorf("%w: body is not a JSON object", ErrBadRequest)
	}
	r := &Request{}
	typeErr, err := scanRequestFields(trimmed, &r.Fields)
	if err != nil {
		return nil, fmt.Errorf("%w: %v", ErrBadRequest, err)
	}
	if typeErr != nil {
		r.typeErr = fmt.Errorf("%w: %v", ErrBadRequest, typeErr)
	}
	return r, nil
}

// trimJSONSpace drops the white space JSON allows around a value (space,
// tab, LF, CR) and nothing else: bytes.TrimSpace would also accept a
// vertical tab, a form feed or a Unicode space, which JSON does not.
func trimJSONSpace(b []byte) []byte {
	s := jsonScan{b: b}
	s.ws()
	b = b[s.i:]
	for len(b) > 0 {
		switch b[len(b)-1] {
		case ' ', '\t', '\n', '\r':
			b = b[:len(b)-1]
			continue
		}
		break
	}
	return b
}

// EncodeRequestWith is EncodeRequest with deployment quirks.
func (t *Tokenizer) EncodeRequestWith(engine, path string, body []byte, opts RequestOptions) (RequestTokens, error) {
	if _, err := requestKind(engine, path); err != nil {
		return RequestTokens{}, err
	}
	req, err := ParseRequest(body)
	if err != nil {
		return RequestTokens{}, err
	}
	return t.EncodeParsed(engine, path, req, opts)
}

// requestKind checks the engine and names the request kind of path.
func requestKind(engine, path string) (string, error) {
	switch engine {
	case EngineVLLM, EngineSGLang, EngineTRTLLM, EngineLlamaCPP:
	default:
		return "", fmt.Errorf("%w %q (want vllm, sglang, trtllm or llamacpp)", ErrUnknownEngine, engine)
	}
	if i := strings.IndexByte(path, '?'); i >= 0 {
		path = path[:i]
	}
	var kind string
	switch strings.TrimSuffix(path, "/") {
	case PathCompletions:
		kind = KindCompletions
	case PathChatCompletions:
		kind = KindChat
	default:
		return "", fmt.Errorf("%w %q (want %s or %s)", ErrUnsupportedPath, path, PathCompletions, PathChatCompletions)
	}
	return kind, nil
}

// EncodeParsed is EncodeRequestWith on a body already read by ParseRequest.
func (t *Tokenizer) EncodeParsed(engine, path string, r *Request, opts RequestOptions) (RequestTokens, error) {
	kind, err := requestKind(engine, path)
	if err != nil {
		return RequestTokens{}, err
	}
	if r.typeErr != nil {
		return RequestTokens{}, r.typeErr
	}
	req := &r.Fields
	out := RequestTokens{Model: req.Model, Kind: kind, Unhashable: unhashableReason(req, kind == KindCompletions)}
	if kind == KindCompletions {
		err = t.encodeCompletions(&out, engine, req, opts)
	} else {
		err = t.encodeChat(&out, engine, req, opts)
	}
	if err != nil {
		return RequestTokens{}, err
	}
	// vLLM (and TRT-LLM, which shares its request schema) keep only the
	// last k prompt tokens when truncate_prompt_tokens is set.
	if k := req.TruncatePromptTokens; k != nil && *k > 0 && (engine == EngineVLLM || engine == EngineTRTLLM) && int64(len(out.IDs)) > *k {
		out.IDs = out.IDs[int64(len(out.IDs))-*k:]
	}
	return out, nil
}

func present(raw json.RawMessage) bool { return len(raw) > 0 && string(raw) != "null" }

// unhashableReason names request fields that make the engine's block hash
// depend on more than token ids. Chat requests add multimodal content
// parts when their messages are decoded (encodeChat), so that the
// messages are read once.
func unhashableReason(r *RequestFields, checkParts bool) string {
	var reasons []string
	if present(r.CacheSalt) {
		reasons = append(reasons, "cache_salt")
	}
	if present(r.LoRAPath) || present(r.LoRAName) || present(r.LoRARequest) {
		reasons = append(reasons, "LoRA adapter")
	}
	if present(r.PromptEmbeds) {
		reasons = append(reasons, "prompt_embeds")
	}
	if present(r.MultiModalData) || present(r.ImageData) {
		reasons = append(reasons, "multimodal input")
	}
	if present(r.ChatTemplate) {
		reasons = append(reasons, "request-supplied chat_template")
	}
	if checkParts && present(r.Messages) {
		if msgs, err := decodeOrdered(r.Messages); err == nil {
			if part := firstNonTextPart(msgs); part != "" {
				reasons = append(reasons, partReason(part))
			}
		}
	}
	return strings.Join(reasons, ", ")
}

func partReason(part string) string { return "multimodal content part " + part }

// addReason appends a reason to a non-empty Unhashable list.
func addReason(list, reason string) string {
	if list == "" {
		return reason
	}
	return list + ", " + reason
}

// firstNonTextPart returns the type of the first non-text content part in
// the decoded messages, or "". It reads parts as encoding/json would into
// []struct{Type string}: the "type" key matches case-insensitively (the
// last such key wins), a null type is no type, and a message with a part
// that is not an object or whose type is not a string is passed over
// (such a request is refused by the renderer anyway).
func firstNonTextPart(msgs jinja.Value) string {
	if !msgs.IsList() {
		return ""
	}
	for _, m := range msgs.AsList().Items {
		if !m.IsDict() {
			continue
		}
		c, ok := contentOf(m.AsDict())
		if !ok || !c.IsList() {
			continue
		}
		if t := firstPartType(c.AsList()); t != "" {
			return t
		}
	}
	return ""
}

// contentOf is the message's "content" as encoding/json picks it: the
// last key that equals "content" case-insensitively.
func contentOf(d *jinja.Dict) (jinja.Value, bool) {
	var v jinja.Value
	found := false
	for _, k := range d.Keys {
		if strings.EqualFold(k, "content") {
			v, found = d.Data[k], true
		}
	}
	return v, found
}

// firstPartType returns the first part type other than "" and "text", ""
// when there is none or a part is malformed.
func firstPartType(parts *jinja.List) string {
	first := ""
	for _, p := range parts.Items {
		if p.IsNone() {
			continue // a null part decodes to the zero part
		}
		if !p.IsDict() {
			return ""
		}
		d := p.AsDict()
		typ := ""
		for _, k := range d.Keys {
			if !strings.EqualFold(k, "type") {
				continue
			}
			switch v := d.Data[k]; {
			case v.IsString():
				typ = v.AsString()
			case v.IsNone():
			default:
				return ""
			}
		}
		if first == "" && typ != "" && typ != "text" {
			first = typ
		}
	}
	return first
}

func (t *Tokenizer) encodeCompletions(out *RequestTokens, engine string, req *RequestFields, opts RequestOptions) error {
	if !present(req.Prompt) {
		if present(req.PromptEmbeds) {
			out.Prompts = 1
			return nil // nothing to encode; Unhashable already says why
		}
		return fmt.Errorf("%w: /v1/completions needs \"prompt\"", ErrBadRequest)
	}
	encode := func(text string) ([]uint32, error) {
		special := true
		var ids []uint32
		switch engine {
		case EngineSGLang:
			if opts.CompletionsBOS {
				if bos, ok := t.TokenID(t.cfg.BOSToken); ok && t.cfg.BOSToken != "" {
					ids = append(ids, bos)
				}
				special = false
			}
		case EngineVLLM, EngineTRTLLM:
			special = req.AddSpecialTokens == nil || *req.AddSpecialTokens
		}
		return t.encodeBounded(ids, text, special, opts)
	}
	var err error
	p := bytes.TrimSpace(req.Prompt)
	switch p[0] {
	case '"':
		var s string
		if err := json.Unmarshal(p, &s); err != nil {
			return fmt.Errorf("%w: prompt: %v", ErrBadRequest, err)
		}
		out.Prompts = 1
		out.IDs, err = encode(s)
		return err
	case '[':
	default:
		return fmt.Errorf("%w: prompt must be a string, a list of strings, or token ids", ErrBadRequest)
	}
	var items []json.RawMessage
	if err := json.Unmarshal(p, &items); err != nil {
		return fmt.Errorf("%w: prompt: %v", ErrBadRequest, err)
	}
	if len(items) == 0 {
		return fmt.Errorf("%w: prompt is an empty list", ErrBadRequest)
	}
	first := bytes.TrimSpace(items[0])
	switch {
	case len(first) > 0 && first[0] == '"':
		// A batch of strings; all must be strings.
		strs := make([]string, len(items))
		for i, it := range items {
			if err := json.Unmarshal(it, &strs[i]); err != nil {
				return fmt.Errorf("%w: prompt[%d] must be a string like prompt[0]", ErrBadRequest, i)
			}
		}
		out.Prompts = len(strs)
		if out.IDs, err = encode(strs[0]); err != nil {
			return err
		}
	case len(first) > 0 && first[0] == '[':
		// A batch of token-id lists.
		for i, it := range items {
			ids, err := parseTokenIDs(it)
			if err != nil {
				return fmt.Errorf("%w: prompt[%d]: %v", ErrBadRequest, i, err)
			}
			if i == 0 {
				if err := tokenBound(len(ids), opts); err != nil {
					return err
				}
				out.IDs = ids
			}
		}
		out.Prompts = len(items)
	default:
		ids, err := parseTokenIDs(p)
		if err != nil {
			return fmt.Errorf("%w: prompt: %v", ErrBadRequest, err)
		}
		if err := tokenBound(len(ids), opts); err != nil {
			return err
		}
		out.IDs, out.Prompts = ids, 1
	}
	return nil
}

// parseTokenIDs reads a JSON list of token ids, which engines take as given.
func parseTokenIDs(raw json.RawMessage) ([]uint32, error) {
	var nums []json.Number
	dec := json.NewDecoder(bytes.NewReader(raw))
	dec.UseNumber()
	if err := dec.Decode(&nums); err != nil {
		return nil, fmt.Errorf("want a list of token ids: %v", err)
	}
	if len(nums) == 0 {
		return nil, errors.New("empty token id list")
	}
	ids := make([]uint32, len(nums))
	for i, n := range nums {
		v, err := n.Int64()
		if err != nil || v < 0 || v > math.MaxUint32 {
			return nil, fmt.Errorf("token id %s at %d is not an integer in [0, %d]", n, i, uint32(math.MaxUint32))
		}
		ids[i] = uint32(v)
	}
	return ids, nil
}

func (t *Tokenizer) encodeChat(out *RequestTokens, engine string, req *RequestFields, opts RequestOptions) error {
	if !present(req.Messages) {
		return fmt.Errorf("%w: /v1/chat/completions needs \"messages\"", ErrBadRequest)
	}
	messages := req.Messages
	co := ChatOptions{
		AddGenerationPrompt:  req.AddGenerationPrompt,
		ContinueFinalMessage: req.ContinueFinalMessage,
		Tools:                req.Tools,
		Documents:            req.Documents,
		Kwargs:               req.ChatTemplateKwargs,
		ParseToolArguments:   true,
	}
	// All engines turn a null content (assistant tool-call turns) into "".
	messages, err := nullContentToEmpty(messages)
	if err != nil {
		return fmt.Errorf("%w: messages: %v", ErrBadRequest, err)
	}
	addSpecial := false
	switch engine {
	case EngineSGLang:
		// SGLang flattens text parts with a space and drops null-valued
		// message keys before rendering.
		co.PartSeparator = " "
		if messages, err = dropNullKeys(messages); err != nil {
			return fmt.Errorf("%w: messages: %v", ErrBadRequest, err)
		}
	case EngineVLLM, EngineTRTLLM:
		addSpecial = req.AddSpecialTokens != nil && *req.AddSpecialTokens
	}
	msgs, err := decodeOrdered(messages)
	if err != nil {
		return fmt.Errorf("%w: messages: %v", ErrBadRequest, err)
	}
	// Before rendering: flattening content lists for the template
	// rewrites the parts this looks at.
	if part := firstNonTextPart(msgs); part != "" {
		out.Unhashable = addReason(out.Unhashable, partReason(part))
	}
	rendered, err := t.renderChatValue(msgs, co)
	if err != nil {
		if errors.Is(err, ErrNoChatTemplate) {
			return fmt.Errorf("model %q: %w", req.Model, err)
		}
		return fmt.Errorf("%w: %v", ErrBadRequest, err)
	}
	out.Rendered = rendered
	out.Prompts = 1
	out.IDs, err = t.encodeBounded(nil, rendered, addSpecial, opts)
	return err
}

// encodeBounded encodes text after dst within opts' bounds: text longer
// than MaxPromptBytes is refused before any work, and encoding stops once
// the ids pass MaxPromptTokens.
func (t *Tokenizer) encodeBounded(dst []uint32, text string, special bool, opts RequestOptions) ([]uint32, error) {
	if opts.MaxPromptBytes > 0 && len(text) > opts.MaxPromptBytes {
		return nil, fmt.Errorf("%w: the prompt text is %d bytes, more than the %d bytes the gateway tokenizes", ErrPromptTooLong, len(text), opts.MaxPromptBytes)
	}
	if dst == nil {
		n := len(text)/3 + 4
		if opts.MaxPromptTokens > 0 {
			n = min(n, opts.MaxPromptTokens+1)
		}
		if dst = opts.IDs[:0]; cap(dst) < n {
			dst = make([]uint32, 0, n)
		}
	}
	ids, ok := t.AppendEncodeLimit(dst, text, special, opts.MaxPromptTokens)
	if !ok {
		return nil, fmt.Errorf("%w: the prompt is more than %d tokens", ErrPromptTooLong, opts.MaxPromptTokens)
	}
	return ids, nil
}

// tokenBound checks a token-id prompt against MaxPromptTokens.
func tokenBound(n int, opts RequestOptions) error {
	if opts.MaxPromptTokens > 0 && n > opts.MaxPromptTokens {
		return fmt.Errorf("%w: the prompt is %d tokens, more than %d", ErrPromptTooLong, n, opts.MaxPromptTokens)
	}
	return nil
}

// rewriteMessages applies f to each message object, keeping key order.
func rewriteMessages(raw json.RawMessage, f func(keys []string, vals []json.RawMessage) ([]string, []json.RawMessage)) (json.RawMessage, error) {
	var msgs []json.RawMessage
	if err := json.Unmarshal(raw, &msgs); err != nil {
		return nil, fmt.Errorf("want a JSON array: %v", err)
	}
	var buf bytes.Buffer
	buf.WriteByte('[')
	for i, m := range msgs {
		if i > 0 {
			buf.WriteByte(',')
		}
		keys, vals, err := objectFields(m)
		if err != nil {
			return nil, fmt.Errorf("[%d]: %v", i, err)
		}
		keys, vals = f(keys, vals)
		buf.WriteByte('{')
		for j, k := range keys {
			if j > 0 {
				buf.WriteByte(',')
			}
			kb, _ := json.Marshal(k)
			buf.Write(kb)
			buf.WriteByte(':')
			buf.Write(vals[j])
		}
		buf.WriteByte('}')
	}
	buf.WriteByte(']')
	return buf.Bytes(), nil
}

// objectFields splits a JSON object into its keys and raw values in order.
func objectFields(raw json.RawMessage) ([]string, []json.RawMessage, error) {
	dec := json.NewDecoder(bytes.NewReader(raw))
	tok, err := dec.Token()
	if err != nil || tok != json.Delim('{') {
		return nil, nil, errors.New("want a JSON object")
	}
	var keys []string
	var vals []json.RawMessage
	for dec.More() {
		kt, err := dec.Token()
		if err != nil {
			return nil, nil, err
		}
		var v json.RawMessage
		if err := dec.Decode(&v); err != nil {
			return nil, nil, err
		}
		keys = append(keys, kt.(string))
		vals = append(vals, v)
	}
	return keys, vals, nil
}

func dropNullKeys(raw json.RawMessage) (json.RawMessage, error) {
	if !bytes.Contains(raw, []byte("null")) {
		return raw, nil
	}
	return rewriteMessages(raw, func(keys []string, vals []json.RawMessage) ([]string, []json.RawMessage) {
		k2, v2 := keys[:0:0], vals[:0:0]
		for i := range keys {
			if string(bytes.TrimSpace(vals[i])) != "null" {
				k2, v2 = append(k2, keys[i]), append(v2, vals[i])
			}
		}
		return k2, v2
	})
}

// nullContentToEmpty turns a null content (assistant tool-call turns) into
// an empty string, as vLLM's message parser and SGLang's chat handler do.
func nullContentToEmpty(raw json.RawMessage) (json.RawMessage, error) {
	if !bytes.Contains(raw, []byte("null")) {
		return raw, nil
	}
	return rewriteMessages(raw, func(keys []string, vals []json.RawMessage) ([]string, []json.RawMessage) {
		for i, k := range keys {
			if k == "content" && string(bytes.TrimSpace(vals[i])) == "null" {
				vals[i] = json.RawMessage(`""`)
			}
		}
		return keys, vals
	})
}

// RequestModel returns the "model" field of a request body, so a caller can
// pick the tokenizer before encoding.
func RequestModel(body []byte) (string, error) {
	var req struct {
		Model *string `json:"model"`
	}
	if err := json.Unmarshal(body, &req); err != nil {
		return "", fmt.Errorf("%w: %v", ErrBadRequest, err)
	}
	if req.Model == nil || *req.Model == "" {
		return "", fmt.Errorf("%w: missing \"model\"", ErrBadRequest)
	}
	return *req.Model, nil
}
