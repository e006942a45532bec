package gateway

import (
	"bytes"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"slices"
	"strings"

	"github.com/zeebo/xxh3"

	"github.com/loxilb-llm/loxilb/pkg/lbrule"
	"github.com/loxilb-llm/loxilb/pkg/proxy"
	"github.com/loxilb-llm/loxilb/pkg/tokenizer"
)

// Routing keys of the hashing selectors (sel 1 hash, 8 chwbl, 9 gpu-aware,
// 10 wrr-hash): model + the prompt prefix at the rule's
// chwbl_prefix_hash_level, + the optional request fields its
// chwbl_prefix_hash_flags select. The key is a 128-bit digest, so its size
// never depends on the prompt's.
//
// Chat requests are keyed on their structure: level 1 on the leading
// system/developer messages (all requests sharing a system prompt meet on
// one ring point, and only the load bound spreads them), level 2 (the
// default) adds the first user message (a conversation keeps its key as its
// history grows; distinct conversations spread), level 3 everything before
// the first assistant turn. When the rule tokenizes, the key is the chained
// block hash covering those messages in the rendered prompt (a hash of the
// first N block hashes) and the tokens after it, so JSON spellings of one
// conversation meet. Completions prompts have no structure: the key
// is the first 512/4096/16384 bytes of the prompt, or, when the rule
// tokenizes, the chained hash of its first 128/1024/4096 tokens' blocks.
// The session_header_name header, when present and selected by the flags,
// replaces the prompt key (Pick).

// keySpec is how one rule keys its requests.
type keySpec struct {
	level       int
	flags       int // 0: every optional field the request carries
	requireSalt bool
}

func keySpecFor(r *lbrule.Rule) keySpec {
	s := r.Service
	ks := keySpec{level: lbrule.DefaultChwblLevel}
	if lbrule.IsHashSel(s.Sel) {
		ks.level, ks.flags, ks.requireSalt = r.ChwblLevel(), s.ChwblPrefixHashFlags, s.ChwblEnableCacheSalt
	}
	return ks
}

func (k keySpec) has(bit int) bool { return k.flags == 0 || k.flags&bit != 0 }

// usesKey reports whether sel hashes the request key.
func usesKey(sel int) bool {
	switch sel {
	case lbrule.SelHash, lbrule.SelCHWBL, lbrule.SelGPUAware, lbrule.SelWRRHash:
		return true
	}
	return false
}

var (
	completionDepthBytes  = [...]int{0, 512, 4096, 16384}
	completionDepthTokens = [...]int{0, 128, 1024, 4096}
)

// keyRequest is what a key may read from an OpenAI-style body (raw
// fields are spans of the body, from tokenizer.ParseRequest).
type keyRequest struct {
	Messages           []keyMessage
	Prompt             json.RawMessage
	CacheSalt          json.RawMessage
	Tools              json.RawMessage
	Documents          json.RawMessage
	ChatTemplate       json.RawMessage
	ChatTemplateKwargs json.RawMessage
	LoraPath           json.RawMessage
	LoraRequest        json.RawMessage
}

// keyMessage is a message's role and raw content.
type keyMessage = tokenizer.MessageSpan

// keyHasher feeds length-prefixed fields, so field boundaries cannot be
// forged by content.
type keyHasher struct{ h *xxh3.Hasher }

func (k keyHasher) field(tag byte, b []byte) {
	var hdr [9]byte
	hdr[0] = tag
	binary.LittleEndian.PutUint64(hdr[1:], uint64(len(b)))
	_, _ = k.h.Write(hdr[:])
	_, _ = k.h.Write(b)
}

// blocks feeds the chained hash of the last full block of ids (a hash of
// all the blocks before it) and the tokens after that block.
func (k keyHasher) blocks(ids []uint32, blockKeys []uint64, blockSize int) {
	full := 0
	if blockSize > 0 {
		full = min(len(ids)/blockSize, len(blockKeys))
	}
	var b [8]byte
	if full > 0 {
		binary.LittleEndian.PutUint64(b[:], blockKeys[full-1])
		k.field('b', b[:])
	}
	tail := make([]byte, 0, 4*(len(ids)-full*blockSize))
	for _, id := range ids[full*blockSize:] {
		tail = binary.LittleEndian.AppendUint32(tail, id)
	}
	k.field('T', tail)
}

func (k keyHasher) sum() []byte {
	s := k.h.Sum128().Bytes()
	return s[:]
}

// keyRequestOf takes what the key needs from the parsed body; ok is false
// when the body is not a JSON object or its messages are malformed.
func keyRequestOf(body *parsedBody) (keyRequest, bool) {
	r, err := body.get()
	if err != nil {
		return keyRequest{}, false
	}
	f := &r.Fields
	kr := keyRequest{Prompt: f.Prompt, CacheSalt: f.CacheSalt, Tools: f.Tools, Documents: f.Documents,
		ChatTemplate: f.ChatTemplate, ChatTemplateKwargs: f.ChatTemplateKwargs, LoraPath: f.LoRAPath, LoraRequest: f.LoRARequest}
	msgs, ok := r.MessageSpans()
	if !ok {
		return keyRequest{}, false
	}
	kr.Messages = msgs
	return kr, true
}

// checkCacheSalt enforces chwbl_enable_cache_salt on an inference request.
func (k keySpec) checkCacheSalt(kr keyRequest) error {
	if !k.requireSalt {
		return nil
	}
	var s string
	if len(kr.CacheSalt) == 0 || json.Unmarshal(kr.CacheSalt, &s) != nil || s == "" {
		return fmt.Errorf("%w: this service requires a non-empty string \"cache_salt\" in every request (rule field chwbl_enable_cache_salt)", proxy.ErrBadRequest)
	}
	return nil
}

// optional folds the optional fields the spec selects into the key.
func (k keySpec) optional(kh keyHasher, kr keyRequest) {
	for _, f := range []struct {
		bit int
		tag byte
		v   json.RawMessage
	}{
		{lbrule.ChwblFlagLoRA, 'l', kr.LoraPath}, {lbrule.ChwblFlagLoRA, 'L', kr.LoraRequest},
		{lbrule.ChwblFlagCacheSalt, 's', kr.CacheSalt}, {lbrule.ChwblFlagTools, 't', kr.Tools},
		{lbrule.ChwblFlagRAGTemplate, 'c', kr.ChatTemplate}, {lbrule.ChwblFlagRAGTemplate, 'k', kr.ChatTemplateKwargs},
		{lbrule.ChwblFlagRAGDocuments, 'd', kr.Documents},
	} {
		if k.has(f.bit) && len(f.v) > 0 && string(f.v) != "null" {
			kh.field(f.tag, f.v)
		}
	}
}

// keyedMessages returns the leading messages the spec's level keys on.
func (k keySpec) keyedMessages(msgs []keyMessage) []keyMessage {
	seenUser := false
	for i, m := range msgs {
		switch k.level {
		case lbrule.ChwblLevelSystem:
			if m.Role != "system" && m.Role != "developer" {
				return msgs[:i]
			}
		case lbrule.ChwblLevelConversation:
			if seenUser {
				return msgs[:i]
			}
		default:
			if m.Role == "assistant" {
				return msgs[:i]
			}
		}
		seenUser = seenUser || m.Role == "user"
	}
	return msgs
}

// chatKey keys a chat request on its leading messages.
func (k keySpec) chatKey(model string, kr keyRequest) []byte {
	kh := keyHasher{xxh3.New()}
	kh.field('m', []byte(model))
	k.optional(kh, kr)
	for _, m := range k.keyedMessages(kr.Messages) {
		kh.field('r', []byte(m.Role))
		kh.field('C', k.content(m.Content))
	}
	return kh.sum()
}

// chatTokenKey keys a tokenized chat request on the chained block hash
// covering its rendered prompt up to the end of the keyed messages, plus
// the tokens after the last full block: requests whose keyed messages
// render to the same tokens share a key whatever their JSON spelling.
// ok is false when the keyed messages cannot be found in the rendering in
// order, or their prefix does not tokenize as the prompt's start; the
// caller then uses chatKey.
func (k keySpec) chatTokenKey(model string, kr keyRequest, tok *tokenizer.Tokenizer, rendered string, ids []uint32, blockKeys []uint64, blockSize int) ([]byte, bool) {
	if tok == nil || rendered == "" || blockSize <= 0 {
		return nil, false
	}
	end := 0
	for _, m := range k.keyedMessages(kr.Messages) {
		text := contentText(m.Content)
		if text == "" {
			continue
		}
		i := strings.Index(rendered[end:], text)
		if i < 0 {
			return nil, false
		}
		end += i + len(text)
	}
	if end == 0 {
		return nil, false
	}
	prefix := tok.Encode(rendered[:end], false)
	// The last token may merge with what the template writes after the
	// message; the ones before it are the prompt's.
	n := len(prefix) - 1
	if n <= 0 || n > len(ids) || !slices.Equal(prefix[:n], ids[:n]) {
		return nil, false
	}
	kh := keyHasher{xxh3.New()}
	kh.field('m', []byte(model))
	k.optional(kh, kr)
	kh.blocks(ids[:n], blockKeys, blockSize)
	return kh.sum(), true
}

// contentText is a message's text as a template writes it last: the
// string, or the last text part of a parts list.
func contentText(raw json.RawMessage) string {
	raw = bytes.TrimSpace(raw)
	if len(raw) == 0 {
		return ""
	}
	var s string
	if raw[0] == '"' {
		_ = json.Unmarshal(raw, &s)
		return s
	}
	var parts []struct {
		Type string `json:"type"`
		Text string `json:"text"`
	}
	if json.Unmarshal(raw, &parts) != nil {
		return ""
	}
	for i := len(parts) - 1; i >= 0; i-- {
		if parts[i].Type == "text" && parts[i].Text != "" {
			return parts[i].Text
		}
	}
	return ""
}

// content drops the image or audio parts of a message when the flags
// leave them out of the key.
func (k keySpec) content(raw json.RawMessage) []byte {
	raw = bytes.TrimSpace(raw)
	if k.has(lbrule.ChwblFlagImage) && k.has(lbrule.ChwblFlagAudio) || len(raw) == 0 || raw[0] != '[' {
		return raw
	}
	var parts []json.RawMessage
	if json.Unmarshal(raw, &parts) != nil {
		return raw
	}
	var out []byte
	for _, p := range parts {
		var t struct {
			Type string `json:"type"`
		}
		_ = json.Unmarshal(p, &t)
		switch t.Type {
		case "image_url", "image", "input_image":
			if !k.has(lbrule.ChwblFlagImage) {
				continue
			}
		case "input_audio", "audio_url", "audio":
			if !k.has(lbrule.ChwblFlagAudio) {
				continue
			}
		}
		out = append(out, p...)
		out = append(out, 0)
	}
	return out
}

// completionsKey keys a completions request on its prompt's first bytes.
func (k keySpec) completionsKey(model string, kr keyRequest) []byte {
	kh := keyHasher{xxh3.New()}
	kh.field('m', []byte(model))
	k.optional(kh, kr)
	p := bytes.TrimSpace(kr.Prompt)
	if len(p) > 0 && p[0] == '[' {
		// Batched prompts: the first one.
		var list []json.RawMessage
		if json.Unmarshal(p, &list) == nil && len(list) > 0 && bytes.HasPrefix(bytes.TrimSpace(list[0]), []byte(`"`)) {
			p = bytes.TrimSpace(list[0])
		}
	}
	var s string
	if len(p) > 0 && p[0] == '"' && json.Unmarshal(p, &s) == nil {
		p = []byte(s)
	}
	kh.field('p', p[:min(len(p), completionDepthBytes[k.level])])
	return kh.sum()
}

// tokenBlocksKey keys a tokenized completions prompt on the chained block
// hash that covers its first completionDepthTokens tokens (a hash of the
// first N block hashes), plus the tokens of a trailing partial block.
func (k keySpec) tokenBlocksKey(model string, kr keyRequest, ids []uint32, blockKeys []uint64, blockSize int) []byte {
	kh := keyHasher{xxh3.New()}
	kh.field('m', []byte(model))
	k.optional(kh, kr)
	kh.blocks(ids[:min(len(ids), completionDepthTokens[k.level])], blockKeys, blockSize)
	return kh.sum()
}

// requestKey builds the prompt key of an inference request, or nil when
// the body carries neither messages nor a prompt (the selector then uses
// the client address).
func (k keySpec) requestKey(model, path string, kr keyRequest) []byte {
	switch {
	case path == "/v1/chat/completions" && len(kr.Messages) > 0:
		return k.chatKey(model, kr)
	case len(kr.Prompt) > 0:
		return k.completionsKey(model, kr)
	}
	return nil
}
