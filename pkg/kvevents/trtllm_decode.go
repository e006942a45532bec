package kvevents

import (
	"bytes"
	"encoding/json"
	"fmt"
	"strconv"
)

// TRTKind is the type of one TensorRT-LLM KV-cache event.
type TRTKind uint8

const (
	// TRTUnknown is an event type this decoder does not know (skipped).
	TRTUnknown TRTKind = iota
	// TRTCreated is "created": the KV-cache manager (re)started.
	TRTCreated
	// TRTStored is "stored": a run of blocks entered the cache.
	TRTStored
	// TRTRemoved is "removed": blocks left the cache.
	TRTRemoved
	// TRTUpdated is "updated": priority or cache level changed (no-op here).
	TRTUpdated
)

// String is the event's name as used in metric labels.
func (k TRTKind) String() string {
	switch k {
	case TRTCreated:
		return "created"
	case TRTStored:
		return "stored"
	case TRTRemoved:
		return "removed"
	case TRTUpdated:
		return "updated"
	default:
		return "unknown"
	}
}

// TRTBlock is one stored_block of a TensorRT-LLM "stored" event.
type TRTBlock struct {
	// Hash is the engine's block_hash: a handle that later "removed" events
	// and child blocks' parent_hash refer to. It is not the gateway key.
	Hash   uint64
	Tokens []uint32
	// Plain is false when the block's hash depends on more than its tokens
	// (a non-zero token_extra_id, a cache salt, multimodal keys, a LoRA).
	Plain bool
}

// TRTEvent is one decoded element of a POST /kv_cache_events body.
type TRTEvent struct {
	EventID    uint64
	WindowSize int64
	// Rank is attention_dp_rank, or -1 when absent (no attention DP).
	Rank int
	// HashAlgo is the optional hash_algo of newer builds ("" when absent).
	HashAlgo string
	Kind     TRTKind
	// Type is the raw data.type string.
	Type string

	ParentHash uint64
	HasParent  bool
	Blocks     []TRTBlock
	// Removed lists the engine block hashes of a "removed" event.
	Removed []uint64
}

type trtEnvelope struct {
	EventID         json.Number     `json:"event_id"`
	WindowSize      json.Number     `json:"window_size"`
	AttentionDPRank json.Number     `json:"attention_dp_rank"`
	HashAlgo        string          `json:"hash_algo"`
	Data            json.RawMessage `json:"data"`
}

type trtToken struct {
	TokenID      json.Number `json:"token_id"`
	TokenExtraID json.Number `json:"token_extra_id"`
}

type trtStoredBlock struct {
	BlockHash json.Number     `json:"block_hash"`
	Tokens    []trtToken      `json:"tokens"`
	CacheSalt json.RawMessage `json:"cache_salt"`
	MMKeys    json.RawMessage `json:"mm_keys"`
	LoraID    json.RawMessage `json:"lora_id"`
}

type trtData struct {
	Type        string           `json:"type"`
	ParentHash  json.Number      `json:"parent_hash"`
	Blocks      []trtStoredBlock `json:"blocks"`
	BlockHashes []json.Number    `json:"block_hashes"`
}

// parseU64 converts a JSON number to uint64 exactly. Hashes are size_t and
// routinely exceed 2^53, so they must never pass through float64.
func parseU64(n json.Number, what string) (uint64, error) {
	v, err := strconv.ParseUint(string(n), 10, 64)
	if err != nil {
		return 0, fmt.Errorf("%s %q is not an unsigned 64-bit integer", what, string(n))
	}
	return v, nil
}

func parseI64(n json.Number, what string) (int64, error) {
	v, err := strconv.ParseInt(string(n), 10, 64)
	if err != nil {
		return 0, fmt.Errorf("%s %q is not a 64-bit integer", what, string(n))
	}
	return v, nil
}

// isJSONNullish reports whether a raw optional field is absent, null, or an
// empty container or string.
func isJSONNullish(raw json.RawMessage) bool {
	t := bytes.TrimSpace(raw)
	switch string(t) {
	case "", "null", "[]", "{}", `""`:
		return true
	}
	return false
}

// maxTRTErrs is how many per-event decode errors DecodeTRTLLMBody keeps;
// the rest are only counted (TRTBody.BadEvents).
const maxTRTErrs = 8

// DecodeTRTLLMBody splits a /kv_cache_events body into events and decodes
// each, with the default DecodeLimits. See DecodeTRTLLMBodyLimits.
func DecodeTRTLLMBody(body []byte) (events []TRTEvent, errs []error, err error) {
	events, errs, _, err = DecodeTRTLLMBodyLimits(body, DecodeLimits{})
	return events, errs, err
}

// DecodeTRTLLMBodyLimits splits a /kv_cache_events body into events and
// decodes each. The body must be a JSON array; an element that fails to
// decode is counted in bad, reported in errs (at most maxTRTErrs of them)
// and skipped, so one bad event does not lose the rest of a destructive
// drain. The array is walked one element at a time, and a body with more
// elements than lim.Events, or more stored tokens or block hashes than
// lim.Tokens and lim.Hashes, is refused whole (an error wrapping
// ErrBatchLimit): a body of tiny elements cannot make the decoder hold many
// times its size.
func DecodeTRTLLMBodyLimits(body []byte, lim DecodeLimits) (events []TRTEvent, errs []error, bad int, err error) {
	lim = lim.withDefaults()
	dec := json.NewDecoder(bytes.NewReader(body))
	dec.UseNumber()
	notArray := func(err error) ([]TRTEvent, []error, int, error) {
		return nil, nil, 0, fmt.Errorf("%w: kv_cache_events body is not a JSON array: %w", ErrBadPayload, err)
	}
	tok, err := dec.Token()
	if err != nil {
		return notArray(err)
	}
	if d, ok := tok.(json.Delim); !ok || d != '[' {
		if tok == nil {
			// null decodes as an empty array, as json.Unmarshal into a slice does.
			return nil, nil, 0, nil
		}
		return notArray(fmt.Errorf("got %v", tok))
	}
	tokens, hashes := 0, 0
	for i := 0; dec.More(); i++ {
		if i >= lim.Events {
			return nil, nil, 0, fmt.Errorf("%w: %w: more than %d events in one drain", ErrBadPayload, ErrBatchLimit, lim.Events)
		}
		var raw json.RawMessage
		if err := dec.Decode(&raw); err != nil {
			return notArray(err)
		}
		var ev TRTEvent
		if err := trtObject(raw); err != nil {
			// Cheap refusal of the common garbage: no decoder, no
			// formatted error beyond the few that are kept.
			bad++
			if len(errs) < maxTRTErrs {
				errs = append(errs, fmt.Errorf("event %d: %w", i, err))
			}
			continue
		}
		ev, err := DecodeTRTLLMEvent(raw)
		if err != nil {
			bad++
			if len(errs) < maxTRTErrs {
				errs = append(errs, fmt.Errorf("event %d: %w", i, err))
			}
			continue
		}
		hashes += len(ev.Removed) + len(ev.Blocks)
		for _, b := range ev.Blocks {
			tokens += len(b.Tokens)
		}
		if hashes > lim.Hashes || tokens > lim.Tokens {
			return nil, nil, 0, fmt.Errorf("%w: %w: more than %d block hashes or %d tokens in one drain", ErrBadPayload, ErrBatchLimit, lim.Hashes, lim.Tokens)
		}
		events = append(events, ev)
	}
	if _, err := dec.Token(); err != nil {
		return notArray(err)
	}
	return events, errs, bad, nil
}

// errNotObject is the refusal of a body element that is not a JSON object.
var errNotObject = fmt.Errorf("%w: event is not a JSON object", ErrBadPayload)

func trtObject(raw []byte) error {
	if len(raw) == 0 || raw[0] != '{' {
		return errNotObject
	}
	return nil
}

// DecodeTRTLLMEvent decodes one element of a /kv_cache_events body. Unknown
// keys are ignored; unknown data types decode with Kind TRTUnknown.
func DecodeTRTLLMEvent(raw []byte) (TRTEvent, error) {
	ev := TRTEvent{Rank: -1}
	// Every number lands in a json.Number field, so Unmarshal keeps them
	// exact without a Decoder (and its buffer) per element.
	var env trtEnvelope
	if err := json.Unmarshal(raw, &env); err != nil {
		return ev, fmt.Errorf("%w: %w", ErrBadPayload, err)
	}
	var err error
	if ev.EventID, err = parseU64(env.EventID, "event_id"); err != nil {
		return ev, fmt.Errorf("%w: %w", ErrBadPayload, err)
	}
	if env.WindowSize != "" {
		if ev.WindowSize, err = parseI64(env.WindowSize, "window_size"); err != nil {
			return ev, fmt.Errorf("%w: %w", ErrBadPayload, err)
		}
	}
	if env.AttentionDPRank != "" {
		r, err := parseI64(env.AttentionDPRank, "attention_dp_rank")
		if err != nil || r < 0 || r > 1<<16 {
			return ev, fmt.Errorf("%w: attention_dp_rank %q out of range", ErrBadPayload, string(env.AttentionDPRank))
		}
		ev.Rank = int(r)
	}
	ev.HashAlgo = env.HashAlgo
	if isJSONNullish(env.Data) {
		return ev, fmt.Errorf("%w: event %d has no data", ErrBadPayload, ev.EventID)
	}
	var data trtData
	if err := json.Unmarshal(env.Data, &data); err != nil {
		return ev, fmt.Errorf("%w: event %d data: %w", ErrBadPayload, ev.EventID, err)
	}
	ev.Type = data.Type
	switch data.Type {
	case "created":
		ev.Kind = TRTCreated
	case "updated":
		ev.Kind = TRTUpdated
	case "stored":
		ev.Kind = TRTStored
		if data.ParentHash != "" {
			if ev.ParentHash, err = parseU64(data.ParentHash, "parent_hash"); err != nil {
				return ev, fmt.Errorf("%w: event %d: %w", ErrBadPayload, ev.EventID, err)
			}
			ev.HasParent = true
		}
		ev.Blocks = make([]TRTBlock, 0, len(data.Blocks))
		for i, b := range data.Blocks {
			blk := TRTBlock{Plain: isJSONNullish(b.CacheSalt) && isJSONNullish(b.MMKeys) && isJSONNullish(b.LoraID)}
			if blk.Hash, err = parseU64(b.BlockHash, "block_hash"); err != nil {
				return ev, fmt.Errorf("%w: event %d block %d: %w", ErrBadPayload, ev.EventID, i, err)
			}
			blk.Tokens = make([]uint32, len(b.Tokens))
			for j, t := range b.Tokens {
				id, err := parseU64(t.TokenID, "token_id")
				if err != nil || id > maxTokenID {
					return ev, fmt.Errorf("%w: event %d block %d token %d: token_id %q invalid", ErrBadPayload, ev.EventID, i, j, string(t.TokenID))
				}
				blk.Tokens[j] = uint32(id)
				if t.TokenExtraID != "" && t.TokenExtraID != "0" {
					blk.Plain = false
				}
			}
			ev.Blocks = append(ev.Blocks, blk)
		}
	case "removed":
		ev.Kind = TRTRemoved
		ev.Removed = make([]uint64, len(data.BlockHashes))
		for i, h := range data.BlockHashes {
			if ev.Removed[i], err = parseU64(h, "block_hashes"); err != nil {
				return ev, fmt.Errorf("%w: event %d: %w", ErrBadPayload, ev.EventID, err)
			}
		}
	case "":
		return ev, fmt.Errorf("%w: event %d data has no type", ErrBadPayload, ev.EventID)
	default:
		ev.Kind = TRTUnknown
	}
	return ev, nil
}
