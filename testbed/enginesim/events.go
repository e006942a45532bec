package enginesim

// Event encodings accepted by Config.EventEncoding.
const (
	// EncodingMap is the tagged-map form ({"type": "BlockStored", ...}) of
	// vLLM after PR #42892 and SGLang after PR #37482.
	EncodingMap = "map"
	// EncodingArray is the older tagged-array form (["BlockStored", ...]).
	EncodingArray = "array"
)

type evKind uint8

const (
	evStored evKind = iota
	evRemoved
	evCleared
)

// kvEvent is one engine-neutral cache event; the wire encoders turn it into
// the exact shape each engine publishes.
type kvEvent struct {
	kind         evKind
	keys         []uint64
	digests      [][]byte // vLLM digests, used when events carry bytes hashes
	hasParent    bool
	parent       uint64
	parentDigest []byte
	tokens       []uint32 // all tokens of all blocks in keys, concatenated
	blockSize    int
	extras       [][]string // vLLM extra_keys per block (nil entries for none)
	lora         *loraRef
	// cpu marks an event about the host-memory (offloaded) copies: it is
	// published with medium "CPU", as vLLM's offloading connector does.
	cpu bool
}

// medium is the event's medium string.
func (e *kvEvent) medium() string {
	if e.cpu {
		return "CPU"
	}
	return "GPU"
}

// zmqEncoder renders a batch of events into the msgpack payload of one ZMQ
// message: [ts, [events...], rank].
type zmqEncoder struct {
	engine    string
	encoding  string
	intHashes bool // vLLM VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES
}

func (z zmqEncoder) batch(ts float64, events []kvEvent, rank int) []byte {
	b := make([]byte, 0, 64+len(events)*96)
	b = mpArray(b, 3)
	b = mpFloat64(b, ts)
	b = mpArray(b, len(events))
	for i := range events {
		if z.engine == EngineSGLang {
			b = z.sglangEvent(b, &events[i])
		} else {
			b = z.vllmEvent(b, &events[i])
		}
	}
	return mpInt(b, int64(rank))
}

func (z zmqEncoder) vllmHash(b []byte, key uint64, digest []byte) []byte {
	if z.intHashes || digest == nil {
		return mpUint(b, key)
	}
	return mpBin(b, digest)
}

func (z zmqEncoder) vllmHashes(b []byte, e *kvEvent) []byte {
	b = mpArray(b, len(e.keys))
	for i, k := range e.keys {
		var d []byte
		if i < len(e.digests) {
			d = e.digests[i]
		}
		b = z.vllmHash(b, k, d)
	}
	return b
}

func (z zmqEncoder) vllmParent(b []byte, e *kvEvent) []byte {
	if !e.hasParent {
		return mpNil(b)
	}
	return z.vllmHash(b, e.parent, e.parentDigest)
}

func mpTokens(b []byte, toks []uint32) []byte {
	b = mpArray(b, len(toks))
	for _, t := range toks {
		b = mpUint(b, uint64(t))
	}
	return b
}

// vllmEvent follows vllm/distributed/kv_events.py: the map form lists the
// fields in declaration order and omits those equal to their default
// (kv_cache_spec_sliding_window); the legacy array form is the 8-element
// BlockStored of the releases with lora_name.
func (z zmqEncoder) vllmEvent(b []byte, e *kvEvent) []byte {
	if z.encoding == EncodingArray {
		switch e.kind {
		case evStored:
			b = mpArray(b, 8)
			b = mpStr(b, "BlockStored")
			b = z.vllmHashes(b, e)
			b = z.vllmParent(b, e)
			b = mpTokens(b, e.tokens)
			b = mpUint(b, uint64(e.blockSize))
			b = loraID(b, e)
			b = mpStr(b, e.medium())
			return loraName(b, e)
		case evRemoved:
			b = mpArray(b, 3)
			b = mpStr(b, "BlockRemoved")
			b = z.vllmHashes(b, e)
			return mpStr(b, e.medium())
		default:
			b = mpArray(b, 1)
			return mpStr(b, "AllBlocksCleared")
		}
	}
	switch e.kind {
	case evStored:
		b = mpMap(b, 11)
		b = mpStr(b, "type")
		b = mpStr(b, "BlockStored")
		b = mpStr(b, "block_hashes")
		b = z.vllmHashes(b, e)
		b = mpStr(b, "parent_block_hash")
		b = z.vllmParent(b, e)
		b = mpStr(b, "token_ids")
		b = mpTokens(b, e.tokens)
		b = mpStr(b, "block_size")
		b = mpUint(b, uint64(e.blockSize))
		b = mpStr(b, "lora_id")
		b = loraID(b, e)
		b = mpStr(b, "medium")
		b = mpStr(b, e.medium())
		b = mpStr(b, "lora_name")
		b = loraName(b, e)
		b = mpStr(b, "extra_keys")
		b = mpArray(b, len(e.keys))
		for i := range e.keys {
			var x []string
			if i < len(e.extras) {
				x = e.extras[i]
			}
			if x == nil {
				b = mpNil(b)
				continue
			}
			b = mpArray(b, len(x))
			for _, k := range x {
				b = mpStr(b, k)
			}
		}
		b = mpStr(b, "group_idx")
		b = mpUint(b, 0)
		b = mpStr(b, "kv_cache_spec_kind")
		return mpStr(b, "full_attention")
	case evRemoved:
		b = mpMap(b, 4)
		b = mpStr(b, "type")
		b = mpStr(b, "BlockRemoved")
		b = mpStr(b, "block_hashes")
		b = z.vllmHashes(b, e)
		b = mpStr(b, "medium")
		b = mpStr(b, e.medium())
		b = mpStr(b, "group_idx")
		return mpUint(b, 0)
	default:
		b = mpMap(b, 1)
		b = mpStr(b, "type")
		return mpStr(b, "AllBlocksCleared")
	}
}

func loraID(b []byte, e *kvEvent) []byte {
	if e.lora == nil {
		return mpNil(b)
	}
	return mpUint(b, uint64(e.lora.id))
}

func loraName(b []byte, e *kvEvent) []byte {
	if e.lora == nil {
		return mpNil(b)
	}
	return mpStr(b, e.lora.name)
}

// sglangKeys writes page keys as SGLang does: signed int64 (the uint64 bit
// pattern of the first 8 digest bytes reinterpreted).
func sglangKeys(b []byte, keys []uint64) []byte {
	b = mpArray(b, len(keys))
	for _, k := range keys {
		b = mpInt(b, int64(k))
	}
	return b
}

func sglangParent(b []byte, e *kvEvent) []byte {
	if !e.hasParent {
		return mpNil(b)
	}
	return mpInt(b, int64(e.parent))
}

// sglangEvent follows python/sglang/srt/disaggregation/kv_events.py: tagged
// arrays up to 0.5.x (7-element BlockStored with medium), tagged maps after
// PR #37482 (same fields by name).
func (z zmqEncoder) sglangEvent(b []byte, e *kvEvent) []byte {
	if z.encoding == EncodingMap {
		switch e.kind {
		case evStored:
			b = mpMap(b, 7)
			b = mpStr(b, "type")
			b = mpStr(b, "BlockStored")
			b = mpStr(b, "block_hashes")
			b = sglangKeys(b, e.keys)
			b = mpStr(b, "parent_block_hash")
			b = sglangParent(b, e)
			b = mpStr(b, "token_ids")
			b = mpTokens(b, e.tokens)
			b = mpStr(b, "block_size")
			b = mpUint(b, uint64(e.blockSize))
			b = mpStr(b, "lora_id")
			b = mpNil(b)
			b = mpStr(b, "medium")
			return mpStr(b, e.medium())
		case evRemoved:
			b = mpMap(b, 3)
			b = mpStr(b, "type")
			b = mpStr(b, "BlockRemoved")
			b = mpStr(b, "block_hashes")
			b = sglangKeys(b, e.keys)
			b = mpStr(b, "medium")
			return mpStr(b, e.medium())
		default:
			b = mpMap(b, 1)
			b = mpStr(b, "type")
			return mpStr(b, "AllBlocksCleared")
		}
	}
	switch e.kind {
	case evStored:
		b = mpArray(b, 7)
		b = mpStr(b, "BlockStored")
		b = sglangKeys(b, e.keys)
		b = sglangParent(b, e)
		b = mpTokens(b, e.tokens)
		b = mpUint(b, uint64(e.blockSize))
		b = mpNil(b)
		return mpStr(b, e.medium())
	case evRemoved:
		b = mpArray(b, 3)
		b = mpStr(b, "BlockRemoved")
		b = sglangKeys(b, e.keys)
		return mpStr(b, e.medium())
	default:
		b = mpArray(b, 1)
		return mpStr(b, "AllBlocksCleared")
	}
}
