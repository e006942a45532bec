package kvevents

import (
	"encoding/binary"
	"errors"
	"fmt"
)

// EventKind is the type of one KV-cache event.
type EventKind uint8

const (
	// KindUnknown is an event whose type tag this decoder does not know. It
	// is counted and skipped, never fatal: engines add event types.
	KindUnknown EventKind = iota
	// KindStored is BlockStored: a run of consecutive blocks entered the cache.
	KindStored
	// KindRemoved is BlockRemoved: blocks left the cache.
	KindRemoved
	// KindCleared is AllBlocksCleared: the publisher's whole cache was reset.
	KindCleared
)

// String is the event's name as used in metric labels.
func (k EventKind) String() string {
	switch k {
	case KindStored:
		return "stored"
	case KindRemoved:
		return "removed"
	case KindCleared:
		return "cleared"
	default:
		return "unknown"
	}
}

// KeyOrder says how a block hash sent as raw digest bytes maps onto the
// 64-bit inventory key. It must agree with how the request side truncates
// its own digests (pkg/blockhash KeyOf).
type KeyOrder uint8

const (
	// KeyLast8 is vLLM: int.from_bytes(digest, "big") & (2**64-1), which is
	// the last eight digest bytes read big-endian (left-padded with zeros
	// when the digest is shorter than eight bytes).
	KeyLast8 KeyOrder = iota
	// KeyFirst8 is SGLang: int(hex[:16], 16), the first eight digest bytes
	// read big-endian. Digests shorter than eight bytes are rejected.
	KeyFirst8
)

// keyFromBytes converts a raw digest to the inventory key.
func (o KeyOrder) keyFromBytes(b []byte) (uint64, error) {
	switch o {
	case KeyFirst8:
		if len(b) < 8 {
			return 0, fmt.Errorf("block hash of %d bytes is shorter than the 8-byte key", len(b))
		}
		return binary.BigEndian.Uint64(b[:8]), nil
	default:
		if len(b) >= 8 {
			return binary.BigEndian.Uint64(b[len(b)-8:]), nil
		}
		var tmp [8]byte
		copy(tmp[8-len(b):], b)
		return binary.BigEndian.Uint64(tmp[:]), nil
	}
}

// Event is one decoded vLLM or SGLang KV event. Slices alias buffers owned
// by the Batch (and byte slices alias the payload): they are valid until the
// Batch is decoded into again.
type Event struct {
	Kind EventKind
	// Tag is the event's type name as sent ("BlockStored", ...).
	Tag []byte

	// Hashes are the inventory keys of block_hashes, in order.
	Hashes []uint64
	// Parent is parent_block_hash as a key; HasParent is false when it was
	// nil (the first block's parent is the chain root).
	Parent    uint64
	HasParent bool
	// Tokens is token_ids: every token of every block in the event.
	Tokens []uint32
	// BlockSize is the block_size field, or -1 when absent.
	BlockSize int
	// Medium is the storage tier ("GPU", "CPU", ...); empty when nil/absent.
	Medium []byte
	// GroupIdx is the KV-cache group (vLLM hybrid models), -1 when absent.
	GroupIdx int
	// SpecKind is kv_cache_spec_kind ("full_attention", ...), empty when
	// absent.
	SpecKind []byte

	// Flags marking blocks whose hash includes more than the plain token
	// chain. Parity attestation skips such events: the gateway cannot
	// recompute their keys from tokens alone.
	HasExtraKeys bool // vLLM extra_keys with a non-nil entry
	HasLoRA      bool // lora_id or lora_name set
	HasCacheSalt bool // SGLang cache_salt metadata
	// TokensInexact is set when token_ids held something other than plain
	// 32-bit token ids (EAGLE bigram tuples, negative or oversized values).
	TokensInexact bool

	hashLo, hashHi int
	tokLo, tokHi   int
}

// Plain reports whether the event's blocks are plain-text blocks whose keys
// follow from their tokens alone.
func (e *Event) Plain() bool {
	return !e.HasExtraKeys && !e.HasLoRA && !e.HasCacheSalt && !e.TokensInexact
}

// Batch is one decoded EventBatch. It is reused across decodes so steady
// state ingestion allocates nothing.
type Batch struct {
	// TS is the publisher's timestamp (seconds since the epoch).
	TS float64
	// Rank is data_parallel_rank (vLLM) or attn_dp_rank (SGLang); -1 when
	// the batch did not carry one (older publishers).
	Rank   int
	Events []Event

	hashes []uint64
	tokens []uint32
}

// Capacities a Batch keeps between decodes; a rare larger batch is not
// held for the life of the subscription.
const (
	keepEvents = 4096
	keepHashes = 1 << 16
	keepTokens = 1 << 18
)

// Trim releases buffers a large batch left behind. Call it once the
// batch's events are no longer used.
func (b *Batch) Trim() {
	if cap(b.Events) > keepEvents {
		b.Events = nil
	}
	if cap(b.hashes) > keepHashes {
		b.hashes = nil
	}
	if cap(b.tokens) > keepTokens {
		b.tokens = nil
	}
}

// growExact makes room for n more elements (n already checked against
// limit) in one allocation: doubling, as append does, but never past the
// batch limit, and never rounded up past it (append's size classes and
// its 1.25 growth would allocate several times the final size for a
// batch that is large from the start).
func growExact[E any](s []E, n, limit int) []E {
	if n <= cap(s)-len(s) {
		return s
	}
	c := max(len(s)+n, min(2*cap(s), limit))
	ns := make([]E, len(s), c)
	copy(ns, s)
	return ns
}

// ErrBadPayload wraps every decode failure of an event payload. Callers count
// it and drop the batch; it is never fatal to a subscription.
var ErrBadPayload = errors.New("bad KV event payload")

// ErrBatchLimit wraps (with ErrBadPayload) the refusal of a batch that
// announces more events, block hashes or token ids than DecodeLimits
// allow. It is checked against each container's announced length before
// the container is decoded, so a small payload cannot make the decoder
// allocate far more than its own size.
var ErrBatchLimit = errors.New("KV event batch over a decode limit")

// DecodeLimits caps one decoded batch. Zero fields take the defaults
// (DefaultMaxBatchEvents, DefaultMaxBatchHashes, DefaultMaxBatchTokens).
type DecodeLimits struct {
	// Events caps the events of one batch.
	Events int
	// Hashes caps the block hashes of one batch, all events together.
	Hashes int
	// Tokens caps the token ids of one batch, all events together.
	Tokens int
}

func (l DecodeLimits) withDefaults() DecodeLimits {
	if l.Events <= 0 {
		l.Events = DefaultMaxBatchEvents
	}
	if l.Hashes <= 0 {
		l.Hashes = DefaultMaxBatchHashes
	}
	if l.Tokens <= 0 {
		l.Tokens = DefaultMaxBatchTokens
	}
	return l
}

// overLimit reports a container that would take a batch past a cap.
func overLimit(what string, have, n, limit int) error {
	if n > limit-have {
		return fmt.Errorf("%w: %d more %s after %d, limit %d per batch", ErrBatchLimit, n, what, have, limit)
	}
	return nil
}

// maxTokenID bounds token ids: anything above 2^32-1 cannot be a vocabulary
// index and is flagged instead of truncated.
const maxTokenID = 1<<32 - 1

// Decoder decodes msgpack EventBatch payloads from vLLM and SGLang
// publishers. It accepts every encoding either engine has shipped: outer
// batch as a positional array (2 or 3 elements) or a map; inner events as
// tagged arrays of any historical length or as maps keyed by "type"; block
// hashes as unsigned or signed integers or raw digest bytes. A Decoder is not
// safe for concurrent use; use one per subscription goroutine.
type Decoder struct {
	order KeyOrder
	lim   DecodeLimits
	r     mpReader
}

// NewDecoder returns a Decoder mapping digest bytes to keys with order,
// with the default DecodeLimits.
func NewDecoder(order KeyOrder) *Decoder {
	return &Decoder{order: order, lim: DecodeLimits{}.withDefaults()}
}

// WithLimits sets the caps of one batch and returns d.
func (d *Decoder) WithLimits(l DecodeLimits) *Decoder {
	d.lim = l.withDefaults()
	return d
}

// Decode parses payload into b, replacing its previous content. On error b
// holds no events and the error wraps ErrBadPayload.
func (d *Decoder) Decode(payload []byte, b *Batch) error {
	b.TS, b.Rank = 0, -1
	b.Events = b.Events[:0]
	b.hashes = b.hashes[:0]
	b.tokens = b.tokens[:0]
	d.r.reset(payload)
	if err := d.decodeBatch(b); err != nil {
		b.Events = b.Events[:0]
		return fmt.Errorf("%w: %w", ErrBadPayload, err)
	}
	if d.r.remaining() != 0 {
		b.Events = b.Events[:0]
		return fmt.Errorf("%w: %d trailing bytes after the batch", ErrBadPayload, d.r.remaining())
	}
	// Hash and token slices are cut only now: the backing arrays may have
	// moved while the batch was growing.
	for i := range b.Events {
		e := &b.Events[i]
		e.Hashes = b.hashes[e.hashLo:e.hashHi:e.hashHi]
		e.Tokens = b.tokens[e.tokLo:e.tokHi:e.tokHi]
	}
	return nil
}

func (d *Decoder) decodeBatch(b *Batch) error {
	r := &d.r
	n, ok, err := r.arrayLen()
	if err != nil {
		return err
	}
	if ok {
		if n < 2 {
			return r.errAt("event batch array has %d elements, want 2 or 3", n)
		}
		if b.TS, err = r.float(); err != nil {
			return fmt.Errorf("batch ts: %w", err)
		}
		if err := d.decodeEvents(b); err != nil {
			return err
		}
		if n >= 3 {
			if err := d.decodeRank(b); err != nil {
				return err
			}
		}
		for i := 3; i < n; i++ {
			if err := r.skip(); err != nil {
				return err
			}
		}
		return nil
	}
	n, ok, err = r.mapLen()
	if err != nil {
		return err
	}
	if !ok {
		return r.errAt("event batch is neither an array nor a map")
	}
	sawEvents := false
	for i := 0; i < n; i++ {
		k, err := r.str()
		if err != nil {
			return fmt.Errorf("batch key: %w", err)
		}
		switch string(k) {
		case "ts":
			if b.TS, err = r.float(); err != nil {
				return fmt.Errorf("batch ts: %w", err)
			}
		case "events":
			if err := d.decodeEvents(b); err != nil {
				return err
			}
			sawEvents = true
		case "data_parallel_rank", "attn_dp_rank":
			if err := d.decodeRank(b); err != nil {
				return err
			}
		default:
			if err := r.skip(); err != nil {
				return err
			}
		}
	}
	if !sawEvents {
		return errors.New("event batch map has no events")
	}
	return nil
}

func (d *Decoder) decodeRank(b *Batch) error {
	if d.r.isNil() {
		return nil
	}
	v, err := d.r.smallInt()
	if err != nil {
		return fmt.Errorf("batch rank: %w", err)
	}
	if v < 0 || v > 1<<16 {
		return fmt.Errorf("batch rank %d out of range", v)
	}
	b.Rank = int(v)
	return nil
}

func (d *Decoder) decodeEvents(b *Batch) error {
	n, ok, err := d.r.arrayLen()
	if err != nil {
		return err
	}
	if !ok {
		return d.r.errAt("events is not an array")
	}
	if err := overLimit("events", len(b.Events), n, d.lim.Events); err != nil {
		return err
	}
	// n is bounded by the cap and the bytes left: size the slice once
	// rather than through append's growth steps.
	b.Events = growExact(b.Events, n, d.lim.Events)
	for i := 0; i < n; i++ {
		if len(b.Events) < cap(b.Events) {
			b.Events = b.Events[:len(b.Events)+1]
		} else {
			b.Events = append(b.Events, Event{})
		}
		e := &b.Events[len(b.Events)-1]
		*e = Event{BlockSize: -1, GroupIdx: -1, hashLo: len(b.hashes), hashHi: len(b.hashes), tokLo: len(b.tokens), tokHi: len(b.tokens)}
		if err := d.decodeEvent(b, e); err != nil {
			return fmt.Errorf("event %d: %w", i, err)
		}
	}
	return nil
}

func kindOf(tag []byte) EventKind {
	switch string(tag) {
	case "BlockStored":
		return KindStored
	case "BlockRemoved":
		return KindRemoved
	case "AllBlocksCleared":
		return KindCleared
	}
	return KindUnknown
}

func (d *Decoder) decodeEvent(b *Batch, e *Event) error {
	r := &d.r
	n, ok, err := r.arrayLen()
	if err != nil {
		return err
	}
	if ok {
		return d.decodeArrayEvent(b, e, n)
	}
	n, ok, err = r.mapLen()
	if err != nil {
		return err
	}
	if !ok {
		return r.errAt("event is neither a tagged array nor a map")
	}
	return d.decodeMapEvent(b, e, n)
}

// decodeArrayEvent decodes the positional form: the tag, then fields in
// declaration order with trailing defaults omitted, so any length is valid.
func (d *Decoder) decodeArrayEvent(b *Batch, e *Event, n int) error {
	r := &d.r
	if n == 0 {
		return errors.New("empty event array")
	}
	tag, err := r.str()
	if err != nil {
		return fmt.Errorf("event tag: %w", err)
	}
	e.Tag, e.Kind = tag, kindOf(tag)
	i := 1
	switch e.Kind {
	case KindStored:
		// block_hashes, parent_block_hash, token_ids, block_size, lora_id,
		// medium, then (vLLM) lora_name, extra_keys, group_idx,
		// kv_cache_spec_kind, kv_cache_spec_sliding_window; (SGLang) a
		// metadata map {"cache_salt": ...} at the lora_name position.
		for ; i < n; i++ {
			var err error
			switch i {
			case 1:
				err = d.hashList(b, e)
			case 2:
				err = d.parent(e)
			case 3:
				err = d.tokenList(b, e)
			case 4:
				err = d.blockSize(e)
			case 5:
				err = d.loraID(e)
			case 6:
				err = d.medium(e)
			case 7:
				err = d.loraNameOrMeta(e)
			case 8:
				err = d.extraKeys(e)
			case 9:
				err = d.groupIdx(e)
			case 10:
				err = d.specKind(e)
			default:
				err = r.skip()
			}
			if err != nil {
				return fmt.Errorf("BlockStored field %d: %w", i, err)
			}
		}
	case KindRemoved:
		// block_hashes, medium, group_idx.
		for ; i < n; i++ {
			var err error
			switch i {
			case 1:
				err = d.hashList(b, e)
			case 2:
				err = d.medium(e)
			case 3:
				err = d.groupIdx(e)
			default:
				err = r.skip()
			}
			if err != nil {
				return fmt.Errorf("BlockRemoved field %d: %w", i, err)
			}
		}
	default:
		for ; i < n; i++ {
			if err := r.skip(); err != nil {
				return err
			}
		}
	}
	return nil
}

// decodeMapEvent decodes the keyed form. "type" is normally first, but the
// fields are decoded by name in any order and unknown keys are skipped.
func (d *Decoder) decodeMapEvent(b *Batch, e *Event, n int) error {
	r := &d.r
	for i := 0; i < n; i++ {
		k, err := r.str()
		if err != nil {
			return fmt.Errorf("event key: %w", err)
		}
		switch string(k) {
		case "type":
			tag, err := r.str()
			if err != nil {
				return fmt.Errorf("event type: %w", err)
			}
			e.Tag, e.Kind = tag, kindOf(tag)
		case "block_hashes":
			err = d.hashList(b, e)
		case "parent_block_hash":
			err = d.parent(e)
		case "token_ids":
			err = d.tokenList(b, e)
		case "block_size":
			err = d.blockSize(e)
		case "lora_id":
			err = d.loraID(e)
		case "lora_name":
			err = d.loraNameOrMeta(e)
		case "medium":
			err = d.medium(e)
		case "extra_keys":
			err = d.extraKeys(e)
		case "group_idx":
			err = d.groupIdx(e)
		case "kv_cache_spec_kind":
			err = d.specKind(e)
		case "cache_salt":
			if !r.isNil() {
				e.HasCacheSalt = true
				err = r.skip()
			}
		default:
			err = r.skip()
		}
		if err != nil {
			return fmt.Errorf("field %q: %w", k, err)
		}
	}
	if e.Tag == nil {
		return errors.New(`event map has no "type"`)
	}
	return nil
}

// hash reads one block hash: unsigned int (vLLM), signed int (SGLang, some
// older vLLM), both kept as their 64 bits, or raw digest bytes.
func (d *Decoder) hash() (uint64, error) {
	v, _, ok, err := d.r.integer()
	if err != nil {
		return 0, err
	}
	if ok {
		return v, nil
	}
	s, isBin, ok, err := d.r.strOrBin()
	if err != nil {
		return 0, err
	}
	if !ok || !isBin {
		return 0, d.r.errAt("block hash is neither an integer nor bytes")
	}
	return d.order.keyFromBytes(s)
}

func (d *Decoder) hashList(b *Batch, e *Event) error {
	n, ok, err := d.r.arrayLen()
	if err != nil {
		return err
	}
	if !ok {
		return d.r.errAt("block_hashes is not an array")
	}
	if err := overLimit("block hashes", len(b.hashes), n, d.lim.Hashes); err != nil {
		return err
	}
	b.hashes = growExact(b.hashes, n, d.lim.Hashes)
	e.hashLo = len(b.hashes)
	r := &d.r
	for i := 0; i < n; i++ {
		if r.off+9 <= len(r.b) && r.b[r.off] == 0xcf {
			b.hashes = append(b.hashes, binary.BigEndian.Uint64(r.b[r.off+1:]))
			r.off += 9
			continue
		}
		h, err := d.hash()
		if err != nil {
			return fmt.Errorf("block_hashes[%d]: %w", i, err)
		}
		b.hashes = append(b.hashes, h)
	}
	e.hashHi = len(b.hashes)
	return nil
}

func (d *Decoder) parent(e *Event) error {
	if d.r.isNil() {
		e.HasParent = false
		return nil
	}
	h, err := d.hash()
	if err != nil {
		return err
	}
	e.Parent, e.HasParent = h, true
	return nil
}

func (d *Decoder) tokenList(b *Batch, e *Event) error {
	r := &d.r
	if r.isNil() {
		return nil
	}
	n, ok, err := r.arrayLen()
	if err != nil {
		return err
	}
	if !ok {
		return r.errAt("token_ids is not an array")
	}
	if err := overLimit("token ids", len(b.tokens), n, d.lim.Tokens); err != nil {
		return err
	}
	b.tokens = growExact(b.tokens, n, d.lim.Tokens)
	e.tokLo = len(b.tokens)
	i := d.tokenRun(b, n)
	for ; i < n; i++ {
		// Fast path for the encodings token ids actually use (positive
		// fixint, uint8/16/32); everything else goes through integer().
		if r.off < len(r.b) {
			switch c := r.b[r.off]; {
			case c <= 0x7f:
				r.off++
				b.tokens = append(b.tokens, uint32(c))
				continue
			case c == 0xcd && r.off+3 <= len(r.b):
				b.tokens = append(b.tokens, uint32(binary.BigEndian.Uint16(r.b[r.off+1:])))
				r.off += 3
				continue
			case c == 0xce && r.off+5 <= len(r.b):
				b.tokens = append(b.tokens, binary.BigEndian.Uint32(r.b[r.off+1:]))
				r.off += 5
				continue
			}
		}
		v, kind, ok, err := r.integer()
		if err != nil {
			return err
		}
		if !ok {
			// EAGLE bigram pages carry tuples; keep the key, skip the
			// token (the event is then excluded from attestation).
			e.TokensInexact = true
			if err := r.skip(); err != nil {
				return err
			}
			continue
		}
		if kind == intSigned || v > maxTokenID {
			e.TokensInexact = true
			continue
		}
		b.tokens = append(b.tokens, uint32(v))
	}
	e.tokHi = len(b.tokens)
	return nil
}

// tokenRun decodes the leading run of uint32-encoded token ids (0xce, what
// vLLM's msgpack writes for every id of a large vocabulary) of a token
// list of n ids, straight into the room tokenList made, and returns how
// many it decoded. It stops at the first other encoding, or where fewer
// than 5 bytes remain, for the general loop to go on from there.
func (d *Decoder) tokenRun(b *Batch, n int) int {
	r := &d.r
	k := min(n, (len(r.b)-r.off)/5)
	lo := len(b.tokens)
	dst := b.tokens[lo : lo+k]
	src := r.b[r.off : r.off+5*k]
	i := 0
	for ; i < k; i++ {
		p := src[5*i : 5*i+5 : 5*i+5]
		if p[0] != 0xce {
			break
		}
		dst[i] = binary.BigEndian.Uint32(p[1:])
	}
	b.tokens = b.tokens[:lo+i]
	r.off += 5 * i
	return i
}

func (d *Decoder) blockSize(e *Event) error { return d.optInt("block_size", 1<<20, &e.BlockSize) }

// optInt reads an optional (nil-able) integer field bounded to 0..max into
// dst; nil leaves dst unchanged.
func (d *Decoder) optInt(name string, max int64, dst *int) error {
	if d.r.isNil() {
		return nil
	}
	v, err := d.r.smallInt()
	if err != nil {
		return err
	}
	if v < 0 || v > max {
		return fmt.Errorf("%s %d out of range", name, v)
	}
	*dst = int(v)
	return nil
}

func (d *Decoder) loraID(e *Event) error {
	if d.r.isNil() {
		return nil
	}
	e.HasLoRA = true
	return d.r.skip()
}

// loraNameOrMeta handles the eighth positional BlockStored element, which is
// lora_name (str|nil) in vLLM and a metadata map ({"cache_salt": ...}) in
// SGLang's BlockStoredWithMetadata.
func (d *Decoder) loraNameOrMeta(e *Event) error {
	r := &d.r
	if r.isNil() {
		return nil
	}
	n, ok, err := r.mapLen()
	if err != nil {
		return err
	}
	if !ok {
		e.HasLoRA = true
		return r.skip()
	}
	for i := 0; i < n; i++ {
		k, err := r.str()
		if err != nil {
			return err
		}
		if r.isNil() {
			continue
		}
		switch string(k) {
		case "cache_salt":
			e.HasCacheSalt = true
		case "lora_name", "lora_id":
			e.HasLoRA = true
		}
		if err := r.skip(); err != nil {
			return err
		}
	}
	return nil
}

func (d *Decoder) medium(e *Event) error {
	r := &d.r
	if r.isNil() {
		e.Medium = nil
		return nil
	}
	s, err := r.str()
	if err != nil {
		return err
	}
	e.Medium = s
	return nil
}

func (d *Decoder) extraKeys(e *Event) error {
	r := &d.r
	if r.isNil() {
		return nil
	}
	n, ok, err := r.arrayLen()
	if err != nil {
		return err
	}
	if !ok {
		e.HasExtraKeys = true
		return r.skip()
	}
	for i := 0; i < n; i++ {
		if r.isNil() {
			continue
		}
		e.HasExtraKeys = true
		if err := r.skip(); err != nil {
			return err
		}
	}
	return nil
}

func (d *Decoder) groupIdx(e *Event) error { return d.optInt("group_idx", 1<<16, &e.GroupIdx) }

func (d *Decoder) specKind(e *Event) error {
	if d.r.isNil() {
		return nil
	}
	s, err := d.r.str()
	if err != nil {
		return err
	}
	e.SpecKind = s
	return nil
}
