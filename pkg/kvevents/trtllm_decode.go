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

// DecodeTRTLLMBody splits a /kv_cache_events body into events and decodes
// each. The body must be a JSON array; an element that fails to decode is
// reported in errs (one entry per bad element) and skipped, so one bad event
// does not lose the rest of a destructive drain.
func DecodeTRTLLMBody(body []byte) (events []TRTEvent, errs []error, err error) {
	dec := json.NewDecoder(bytes.NewReader(body))
	dec.UseNumber()
	var raw []json.RawMessage
	if err := dec.Decode(&raw); err != nil {
		return nil, nil, fmt.Errorf("%w: kv_cache_events body is not a JSON array: %w", ErrBadPayload, err)
	}
	events = make([]TRTEvent, 0, len(raw))
	for i, r := range raw {
		ev, err := DecodeTRTLLMEvent(r)
		if err != nil {
			errs = append(errs, fmt.Errorf("event %d: %w", i, err))
			continue
		}
		events = append(events, ev)
	}
	return events, errs, nil
}

// DecodeTRTLLMEvent decodes one element of a /kv_cache_events body. Unknown
// keys are ignored; unknown data types decode with Kind TRTUnknown.
func DecodeTRTLLMEvent(raw []byte) (TRTEvent, error) {
	ev := TRTEvent{Rank: -1}
	dec := json.NewDecoder(bytes.NewReader(raw))
	dec.UseNumber()
	var env trtEnvelope
	if err := dec.Decode(&env); err != nil {
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
	dd := json.NewDecoder(bytes.NewReader(env.Data))
	dd.UseNumber()
	var data trtData
	if err := dd.Decode(&data); err != nil {
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
