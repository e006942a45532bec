package tokenizer

import (
	"bytes"
	"encoding/json"
	"fmt"
	"strings"
	"sync"
	"unicode/utf8"
)

// bpeModel is a HuggingFace "BPE" model. For byte-level tokenizers the
// vocabulary is re-keyed by the raw bytes each entry stands for, so encoding
// never materialises the byte-level alphabet.
type bpeModel struct {
	vocab        map[string]uint32 // raw bytes (byte-level) or plain strings
	merges       mergeTable        // (left id, right id) -> merge
	byteIDs      [256]int64        // byte-level initial symbols, -1 if absent
	byteLevel    bool
	ignoreMerges bool
	byteFallback bool
	unk          int64 // -1 when the model has no unk token
	fuseUnk      bool

	cache      wordCache
	scratchBuf sync.Pool // *bpeScratch
}

type merge struct {
	rank  uint32
	newID uint32
}

type rawBPE struct {
	Type                    string            `json:"type"`
	Vocab                   map[string]uint32 `json:"vocab"`
	Merges                  json.RawMessage   `json:"merges"`
	UnkToken                *string           `json:"unk_token"`
	ContinuingSubwordPrefix *string           `json:"continuing_subword_prefix"`
	EndOfWordSuffix         *string           `json:"end_of_word_suffix"`
	FuseUnk                 bool              `json:"fuse_unk"`
	ByteFallback            bool              `json:"byte_fallback"`
	IgnoreMerges            bool              `json:"ignore_merges"`
	Dropout                 *float64          `json:"dropout"`
}

// parseMerges accepts both serialisations HuggingFace writes: "a b" strings
// (tokenizers < 0.20) and ["a", "b"] pairs. The first element says which
// one a file holds: decoding the other first would run a whole failed
// pass over hundreds of thousands of merges (a third of a Llama 3 load's
// time and garbage, spent while the daemon serves requests).
func parseMerges(raw json.RawMessage) ([][2]string, error) {
	if len(raw) == 0 || string(raw) == "null" {
		return nil, nil
	}
	if firstElement(raw) == '"' {
		if pairs, err := parseMergeLines(raw); err == nil {
			return pairs, nil
		}
	}
	var pairs [][2]string
	if err := json.Unmarshal(raw, &pairs); err == nil {
		return pairs, nil
	}
	return parseMergeLines(raw)
}

// firstElement is the first byte of a JSON array's first element, or 0.
func firstElement(raw []byte) byte {
	s := bytes.TrimLeft(raw, " \t\r\n")
	if len(s) == 0 || s[0] != '[' {
		return 0
	}
	s = bytes.TrimLeft(s[1:], " \t\r\n")
	if len(s) == 0 {
		return 0
	}
	return s[0]
}

// parseMergeLines decodes the "a b" form of merges.
func parseMergeLines(raw json.RawMessage) ([][2]string, error) {
	var lines []string
	if err := json.Unmarshal(raw, &lines); err != nil {
		return nil, fmt.Errorf("merges: neither [\"a b\"] nor [[a,b]]: %w", err)
	}
	pairs := make([][2]string, len(lines))
	for i, l := range lines {
		a, b, ok := strings.Cut(l, " ")
		if !ok || strings.Contains(b, " ") {
			return nil, fmt.Errorf("merges[%d] %q: want two space-separated parts", i, l)
		}
		pairs[i] = [2]string{a, b}
	}
	return pairs, nil
}

func newBPEModel(raw json.RawMessage, byteLevel bool, alpha *byteLevelAlphabet) (*bpeModel, map[uint32]string, error) {
	var r rawBPE
	if err := json.Unmarshal(raw, &r); err != nil {
		return nil, nil, fmt.Errorf("model: %w", err)
	}
	if r.Type != "BPE" && r.Type != "" {
		return nil, nil, fmt.Errorf("unsupported model type %q (only BPE)", r.Type)
	}
	if r.Vocab == nil {
		return nil, nil, fmt.Errorf("model: missing vocab")
	}
	if r.Dropout != nil && *r.Dropout > 0 {
		return nil, nil, fmt.Errorf("model: BPE dropout %v is non-deterministic", *r.Dropout)
	}
	if r.ContinuingSubwordPrefix != nil && *r.ContinuingSubwordPrefix != "" {
		return nil, nil, fmt.Errorf("model: continuing_subword_prefix %q is not supported", *r.ContinuingSubwordPrefix)
	}
	if r.EndOfWordSuffix != nil && *r.EndOfWordSuffix != "" {
		return nil, nil, fmt.Errorf("model: end_of_word_suffix %q is not supported", *r.EndOfWordSuffix)
	}
	pairs, err := parseMerges(r.Merges)
	if err != nil {
		return nil, nil, fmt.Errorf("model: %w", err)
	}
	m := &bpeModel{
		vocab:        make(map[string]uint32, len(r.Vocab)),
		merges:       newMergeTable(len(pairs)),
		byteLevel:    byteLevel,
		ignoreMerges: r.IgnoreMerges,
		byteFallback: r.ByteFallback,
		unk:          -1,
		fuseUnk:      r.FuseUnk,
	}
	m.cache.init()
	m.scratchBuf.New = func() any { return &bpeScratch{} }
	idToToken := make(map[uint32]string, len(r.Vocab))
	for tok, id := range r.Vocab {
		idToToken[id] = tok
		key := tok
		if byteLevel {
			b, ok := alpha.decode(tok)
			if !ok {
				continue // unreachable by byte-level BPE; kept for decode only
			}
			key = string(b)
		}
		if old, dup := m.vocab[key]; dup && old < id {
			continue
		}
		m.vocab[key] = id
	}
	for i := range m.byteIDs {
		m.byteIDs[i] = -1
		if byteLevel {
			if id, ok := m.vocab[string([]byte{byte(i)})]; ok {
				m.byteIDs[i] = int64(id)
			}
		}
	}
	if r.UnkToken != nil {
		id, ok := r.Vocab[*r.UnkToken]
		if !ok {
			return nil, nil, fmt.Errorf("model: unk_token %q not in vocab", *r.UnkToken)
		}
		m.unk = int64(id)
	}
	for i, p := range pairs {
		a, okA := r.Vocab[p[0]]
		b, okB := r.Vocab[p[1]]
		n, okN := r.Vocab[p[0]+p[1]]
		if !okA || !okB || !okN {
			return nil, nil, fmt.Errorf("model: merges[%d] %q %q: token not in vocab", i, p[0], p[1])
		}
		// A repeated pair keeps its last rank, as the Rust HashMap collect does.
		if err := m.merges.set(uint64(a)<<32|uint64(b), merge{rank: uint32(i), newID: n}); err != nil {
			return nil, nil, fmt.Errorf("model: merges[%d]: %w", i, err)
		}
	}
	return m, idToToken, nil
}

// bpeScratch holds the per-call working set so the hot path does not
// allocate once the pool is warm.
type bpeScratch struct {
	syms []symbol
	heap []cand
}

type symbol struct {
	id         uint32
	prev, next int32
	alive      bool
}

type cand struct {
	rank  uint32
	pos   int32
	newID uint32
}

// less orders candidates by (rank, position): the lowest rank merges first
// and equal ranks merge leftmost first. Ordering by rank alone (as some
// ports do) gives different ids for runs like "aaaa" or whitespace runs.
func (c cand) less(o cand) bool {
	if c.rank != o.rank {
		return c.rank < o.rank
	}
	return c.pos < o.pos
}

// encodeWord appends the ids of one pre-tokenized piece.
func (m *bpeModel) encodeWord(dst []uint32, word string) []uint32 {
	if word == "" {
		return dst
	}
	// One or two bytes of a byte-level model need no cache: one symbol
	// cannot merge, and two merge if and only if their pair has a rank.
	// With ignore_merges a two-byte word in the vocabulary is taken as
	// is even without that merge, so it goes the long way.
	if m.byteLevel && len(word) <= 2 {
		a := m.byteIDs[word[0]]
		if len(word) == 1 && a >= 0 {
			return append(dst, uint32(a))
		}
		if b := m.byteIDs[word[len(word)-1]]; len(word) == 2 && a >= 0 && b >= 0 && !m.ignoreMerges {
			if mg, ok := m.merges.get(uint32(a), uint32(b)); ok {
				return append(dst, mg.newID)
			}
			return append(dst, uint32(a), uint32(b))
		}
	}
	if out, ok := m.cache.appendCached(dst, word); ok {
		return out
	}
	if m.ignoreMerges {
		if id, ok := m.vocab[word]; ok {
			return append(dst, id)
		}
	}
	start := len(dst)
	dst = m.merge(dst, word)
	m.cache.put(word, dst[start:])
	return dst
}

func (m *bpeModel) merge(dst []uint32, word string) []uint32 {
	sc := m.scratchBuf.Get().(*bpeScratch)
	defer func() {
		// A word long enough to need more is rare; its working set
		// must not stay pinned in the pool.
		if cap(sc.syms) <= maxPooledScratch && cap(sc.heap) <= maxPooledScratch {
			m.scratchBuf.Put(sc)
		}
	}()
	syms := sc.syms[:0]
	add := func(id uint32) {
		syms = append(syms, symbol{id: id, prev: int32(len(syms)) - 1, next: int32(len(syms)) + 1, alive: true})
	}
	if m.byteLevel {
		for i := 0; i < len(word); i++ {
			if id := m.byteIDs[word[i]]; id >= 0 {
				add(uint32(id))
			} else if m.unk >= 0 {
				add(uint32(m.unk))
			}
		}
	} else {
		for i, r := range word {
			size := utf8.RuneLen(r)
			if r == utf8.RuneError {
				_, size = utf8.DecodeRuneInString(word[i:])
			}
			if id, ok := m.vocab[word[i:i+size]]; ok {
				add(id)
				continue
			}
			if m.byteFallback {
				ok := true
				var ids [4]uint32
				for k := 0; k < size; k++ {
					id, found := m.vocab[byteFallbackToken(word[i+k])]
					if !found {
						ok = false
						break
					}
					ids[k] = id
				}
				if ok {
					for k := 0; k < size; k++ {
						add(ids[k])
					}
					continue
				}
			}
			if m.unk >= 0 {
				if m.fuseUnk && len(syms) > 0 && int64(syms[len(syms)-1].id) == int64(m.unk) {
					continue
				}
				add(uint32(m.unk))
			}
		}
	}
	if len(syms) == 0 {
		sc.syms = syms
		return dst
	}
	syms[len(syms)-1].next = -1

	h := sc.heap[:0]
	push := func(c cand) {
		h = append(h, c)
		i := len(h) - 1
		for i > 0 {
			p := (i - 1) / 2
			if !h[i].less(h[p]) {
				break
			}
			h[i], h[p] = h[p], h[i]
			i = p
		}
	}
	pop := func() cand {
		top := h[0]
		last := len(h) - 1
		h[0] = h[last]
		h = h[:last]
		i := 0
		for {
			l := 2*i + 1
			if l >= len(h) {
				break
			}
			s := l
			if r := l + 1; r < len(h) && h[r].less(h[l]) {
				s = r
			}
			if !h[s].less(h[i]) {
				break
			}
			h[i], h[s] = h[s], h[i]
			i = s
		}
		return top
	}
	for i := 0; i+1 < len(syms); i++ {
		if mg, ok := m.merges.get(syms[i].id, syms[i+1].id); ok {
			push(cand{rank: mg.rank, pos: int32(i), newID: mg.newID})
		}
	}
	for len(h) > 0 {
		c := pop()
		s := &syms[c.pos]
		if !s.alive || s.next < 0 {
			continue
		}
		right := &syms[s.next]
		// Stale entry: one side was merged since this candidate was pushed.
		if mg, ok := m.merges.get(s.id, right.id); !ok || mg.newID != c.newID {
			continue
		}
		s.id = c.newID
		right.alive = false
		s.next = right.next
		if s.next >= 0 {
			syms[s.next].prev = c.pos
		}
		if s.prev >= 0 {
			p := syms[s.prev]
			if mg, ok := m.merges.get(p.id, s.id); ok {
				push(cand{rank: mg.rank, pos: s.prev, newID: mg.newID})
			}
		}
		if s.next >= 0 {
			if mg, ok := m.merges.get(s.id, syms[s.next].id); ok {
				push(cand{rank: mg.rank, pos: c.pos, newID: mg.newID})
			}
		}
	}
	for i := int32(0); i >= 0; i = syms[i].next {
		dst = append(dst, syms[i].id)
	}
	sc.syms, sc.heap = syms, h
	return dst
}

var hexDigits = "0123456789ABCDEF"

func byteFallbackToken(b byte) string {
	return string([]byte{'<', '0', 'x', hexDigits[b>>4], hexDigits[b&15], '>'})
}
