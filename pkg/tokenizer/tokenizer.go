package tokenizer

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"sync"
	"unicode/utf8"

	"golang.org/x/text/unicode/norm"
)

// Tokenizer encodes text exactly as the HuggingFace Rust tokenizer does for
// the same tokenizer.json, and renders chat prompts with the model's
// chat_template. A Tokenizer is immutable after loading and safe for
// concurrent use.
type Tokenizer struct {
	*core
	cfg  Config
	chat *chatTemplate // nil when there is no chat template
	// maxPositions is config.json's max_position_embeddings when the
	// model's config.json was staged next to the tokenizer; 0 otherwise.
	maxPositions int
}

// core is the encoding machinery, shared by Tokenizers that differ only in
// their chat template.
type core struct {
	added      []AddedToken
	rawMatch   *addedMatcher // added tokens with normalized=false: split before normalization
	normMatch  *addedMatcher // added tokens with normalized=true: split after normalization
	normalizer normalizer
	pre        preTokenizer
	// scan, when set, is the whole of pre (see directScanner): encoding
	// walks its matches without materialising the pieces.
	scan       *bpeScanner
	model      *bpeModel
	post       postProcessor
	decoder    decoderKind
	decodeTab  map[uint32][]byte
	tokenToID  map[string]uint32 // vocab strings and added token contents, for lookups by text
	specialIDs map[uint32]bool

	pool  sync.Pool // *encodeScratch
	cache prefixCache
	// resumable: a segment sharing a prefix with a cached one may resume
	// tokenizing from a mark of it (prefixcache.go says when that is exact).
	resumable bool
}

// Config is the subset of tokenizer_config.json the gateway needs.
type Config struct {
	ChatTemplate string // the default template; named templates are in ChatTemplates
	// ChatTemplates holds named templates when chat_template is a list of
	// {name, template} objects (e.g. "default", "tool_use").
	ChatTemplates  map[string]string
	BOSToken       string
	EOSToken       string
	PADToken       string
	UNKToken       string
	AddBOSToken    *bool
	AddEOSToken    *bool
	TokenizerClass string
	// SplitSpecialTokens (split_special_tokens) makes transformers, and so
	// the engines, tokenize special-token text as plain text.
	SplitSpecialTokens bool
	// ModelMaxLength is model_max_length; 0 when absent or the "no
	// limit" sentinel transformers writes.
	ModelMaxLength int
}

type encodeScratch struct {
	segs   []segment
	nsegs  []segment
	pieces []string
	keys   []uint64 // a segment's prefix hashes
	marks  []mark   // a segment's resume marks
}

// Load reads dir/tokenizer.json and, when present, dir/tokenizer_config.json.
func Load(dir string) (*Tokenizer, error) {
	tj, err := os.ReadFile(filepath.Join(dir, "tokenizer.json"))
	if err != nil {
		return nil, fmt.Errorf("read tokenizer.json: %w", err)
	}
	cj, err := os.ReadFile(filepath.Join(dir, "tokenizer_config.json"))
	if err != nil {
		if !errors.Is(err, os.ErrNotExist) {
			return nil, fmt.Errorf("read tokenizer_config.json: %w", err)
		}
		cj = nil
	}
	t, err := LoadJSON(tj, cj)
	if err != nil {
		return nil, fmt.Errorf("load %s: %w", dir, err)
	}
	// config.json is optional: staged, it gives the engine's context
	// length, which bounds the prompts worth tokenizing.
	mc, err := os.ReadFile(filepath.Join(dir, "config.json"))
	switch {
	case err == nil:
		if t.maxPositions, err = parseModelConfig(mc); err != nil {
			return nil, fmt.Errorf("load %s: config.json: %w", dir, err)
		}
	case !errors.Is(err, os.ErrNotExist):
		return nil, fmt.Errorf("read config.json: %w", err)
	}
	return t, nil
}

type rawTokenizer struct {
	AddedTokens   []AddedToken    `json:"added_tokens"`
	Normalizer    json.RawMessage `json:"normalizer"`
	PreTokenizer  json.RawMessage `json:"pre_tokenizer"`
	PostProcessor json.RawMessage `json:"post_processor"`
	Decoder       json.RawMessage `json:"decoder"`
	Model         json.RawMessage `json:"model"`
}

// LoadJSON builds a Tokenizer from the contents of tokenizer.json and,
// optionally (nil is fine), tokenizer_config.json. Every construct that
// would change token ids if ignored is either implemented or rejected with
// an error naming it.
func LoadJSON(tokenizerJSON, tokenizerConfigJSON []byte) (*Tokenizer, error) {
	var raw rawTokenizer
	if err := json.Unmarshal(tokenizerJSON, &raw); err != nil {
		return nil, fmt.Errorf("parse tokenizer.json: %w", err)
	}
	if len(raw.Model) == 0 || string(raw.Model) == "null" {
		return nil, fmt.Errorf("tokenizer.json: missing model")
	}
	t := &Tokenizer{core: &core{added: raw.AddedTokens, specialIDs: map[uint32]bool{}}}
	var err error
	if t.normalizer, err = parseNormalizer(raw.Normalizer, 0); err != nil {
		return nil, fmt.Errorf("tokenizer.json: %w", err)
	}
	var byteLevel bool
	if t.pre, byteLevel, err = parsePreTokenizer(raw.PreTokenizer, 0); err != nil {
		return nil, fmt.Errorf("tokenizer.json: %w", err)
	}
	if sc, ok := directScanner(t.pre); ok {
		t.scan = &sc
	}
	if t.decoder, err = parseDecoder(raw.Decoder); err != nil {
		return nil, fmt.Errorf("tokenizer.json: %w", err)
	}
	alpha := newByteLevelAlphabet()
	model, idToToken, err := newBPEModel(raw.Model, byteLevel, alpha)
	if err != nil {
		return nil, fmt.Errorf("tokenizer.json: %w", err)
	}
	t.model = model
	t.tokenToID = make(map[string]uint32, len(idToToken)+len(raw.AddedTokens))
	for id, s := range idToToken {
		t.tokenToID[s] = id
	}
	// Ids of added tokens are assigned the way HuggingFace's AddedVocabulary
	// does when it loads tokenizer.json: the id of the same text in the
	// vocabulary (or of an earlier added token), else the next free id
	// after the vocabulary. The "id" field is not consulted; for files
	// written by HuggingFace the two agree.
	vocabSize := int64(len(idToToken))
	maxAdded := int64(-1)
	for i := range raw.AddedTokens {
		a := &raw.AddedTokens[i]
		if a.Content == "" {
			return nil, fmt.Errorf("tokenizer.json: added_tokens[%d] (id %d) has empty content", i, a.ID)
		}
		if id, ok := t.tokenToID[a.Content]; ok {
			a.ID = id
		} else {
			switch {
			case maxAdded < 0:
				a.ID = uint32(vocabSize)
			case maxAdded >= vocabSize || vocabSize == 0:
				a.ID = uint32(maxAdded + 1)
			default:
				a.ID = uint32(vocabSize)
			}
		}
		maxAdded = max(maxAdded, int64(a.ID))
	}
	for _, a := range raw.AddedTokens {
		idToToken[a.ID] = a.Content
		t.tokenToID[a.Content] = a.ID
		if a.Special {
			t.specialIDs[a.ID] = true
		}
	}
	t.rawMatch = newAddedMatcher(raw.AddedTokens, func(a AddedToken) bool { return !a.Normalized || t.normalizer == nil })
	t.normMatch = newAddedMatcher(raw.AddedTokens, func(a AddedToken) bool { return a.Normalized && t.normalizer != nil })

	t.decodeTab = make(map[uint32][]byte, len(idToToken))
	for id, s := range idToToken {
		t.decodeTab[id] = t.decoder.tokenBytes(s, alpha)
	}
	if t.post, err = parsePostProcessor(raw.PostProcessor, t.tokenToID, 0); err != nil {
		return nil, fmt.Errorf("tokenizer.json: %w", err)
	}
	if len(tokenizerConfigJSON) > 0 {
		if t.cfg, err = parseConfig(tokenizerConfigJSON); err != nil {
			return nil, fmt.Errorf("tokenizer_config.json: %w", err)
		}
		if t.cfg.SplitSpecialTokens {
			notSpecial := func(normalized bool) func(AddedToken) bool {
				return func(a AddedToken) bool {
					return !a.Special && (a.Normalized && t.normalizer != nil) == normalized
				}
			}
			t.rawMatch = newAddedMatcher(raw.AddedTokens, notSpecial(false))
			t.normMatch = newAddedMatcher(raw.AddedTokens, notSpecial(true))
		}
		if t.cfg.ChatTemplate != "" {
			if t.chat, err = compileChatTemplate(t.cfg.ChatTemplate); err != nil {
				return nil, fmt.Errorf("tokenizer_config.json: %w", err)
			}
		}
	}
	t.pool.New = func() any { return &encodeScratch{} }
	t.resumable = t.scan != nil && !t.normMatch.any && (t.normalizer == nil || t.normalizer == normalizer(normForm{norm.NFC}))
	t.cache.init(DefaultCacheBytes, NewCacheMetrics())
	return t, nil
}

// WithChatTemplate returns a Tokenizer that shares t's vocabulary and
// encoder but renders chats with src (an engine started with
// --chat-template, or a corrected template). t is unchanged.
func (t *Tokenizer) WithChatTemplate(src string) (*Tokenizer, error) {
	ct, err := compileChatTemplate(src)
	if err != nil {
		return nil, err
	}
	cfg := t.cfg
	cfg.ChatTemplate = src
	cfg.ChatTemplates = nil
	return &Tokenizer{core: t.core, cfg: cfg, chat: ct, maxPositions: t.maxPositions}, nil
}

// Config returns the parsed tokenizer_config.json fields.
func (t *Tokenizer) Config() Config { return t.cfg }

// MaxLength is the model's context length in tokens as staged: config.json
// max_position_embeddings (what the engines default to), else
// tokenizer_config.json model_max_length; 0 when neither says.
func (t *Tokenizer) MaxLength() int {
	if t.maxPositions > 0 {
		return t.maxPositions
	}
	return t.cfg.ModelMaxLength
}

// HasChatTemplate reports whether tokenizer_config.json carried a chat template.
func (t *Tokenizer) HasChatTemplate() bool { return t.chat != nil }

// TokenID returns the id of a vocab entry or added token given its text as
// written in tokenizer.json.
func (t *Tokenizer) TokenID(token string) (uint32, bool) {
	id, ok := t.tokenToID[token]
	return id, ok
}

// IsSpecial reports whether id is an added token flagged special.
func (t *Tokenizer) IsSpecial(id uint32) bool { return t.specialIDs[id] }

// AddedTokens returns a copy of the added tokens, sorted by id.
func (t *Tokenizer) AddedTokens() []AddedToken {
	out := append([]AddedToken(nil), t.added...)
	sort.Slice(out, func(i, j int) bool { return out[i].ID < out[j].ID })
	return out
}

// Encode returns the token ids of text. With addSpecialTokens the
// tokenizer.json post-processor (e.g. Llama-3's BOS template) is applied,
// as HuggingFace's encode(text, add_special_tokens=True) does. Literal
// special-token text such as "<|im_end|>" maps to the special id, as in
// HuggingFace with the default split_special_tokens=False.
func (t *Tokenizer) Encode(text string, addSpecialTokens bool) []uint32 {
	return t.AppendEncode(make([]uint32, 0, len(text)/3+4), text, addSpecialTokens)
}

// AppendEncode is Encode appending to dst, for callers that reuse buffers.
func (t *Tokenizer) AppendEncode(dst []uint32, text string, addSpecialTokens bool) []uint32 {
	dst, _ = t.AppendEncodeLimit(dst, text, addSpecialTokens, 0)
	return dst
}

// AppendEncodeLimit is AppendEncode that gives up once more than maxTokens
// ids were produced for text (0: no bound), reporting ok=false. The work
// done is then bounded by the pre-tokenized piece that crossed the bound,
// not by the length of text; dst holds a partial result the caller must
// discard.
func (t *Tokenizer) AppendEncodeLimit(dst []uint32, text string, addSpecialTokens bool, maxTokens int) ([]uint32, bool) {
	limit := -1
	if maxTokens > 0 {
		limit = len(dst) + maxTokens
	}
	if !addSpecialTokens || t.post == nil {
		return t.encodeBody(dst, text, limit)
	}
	ok := true // captured by the closure, so declared only on this path
	dst = t.post.apply(dst, func(d []uint32) []uint32 {
		d, ok = t.encodeBody(d, text, limit)
		return d
	})
	if ok && limit >= 0 && len(dst) > limit {
		ok = false // the post-processor's own tokens crossed it
	}
	return dst, ok
}

// encodeBody encodes text into dst. limit < 0 means no bound; otherwise
// encoding stops, returning false, once len(dst) passes it.
func (t *Tokenizer) encodeBody(dst []uint32, text string, limit int) ([]uint32, bool) {
	sc := t.pool.Get().(*encodeScratch)
	defer t.putScratch(sc)
	sc.segs = t.rawMatch.split(sc.segs[:0], t.added, text, 0, len(text))
	ok := true
	for _, seg := range sc.segs {
		if seg.added {
			dst = append(dst, seg.id)
		} else if s := text[seg.start:seg.end]; !t.cache.cacheable(s) {
			dst, ok = t.encodeSegment(dst, sc, s, limit)
		} else if ids, hit := t.cache.get(s); hit {
			dst = append(dst, ids...)
		} else {
			dst, ok = t.encodeCached(dst, sc, s, limit)
		}
		if !ok || limit >= 0 && len(dst) > limit {
			return dst, false
		}
	}
	return dst, true
}

// encodeCached encodes segment s, which the cache does not hold whole:
// from the last usable mark of a cached segment sharing its prefix when
// there is one, else from its start. It stores the result with s's own
// marks unless only a small tail was new.
func (t *Tokenizer) encodeCached(dst []uint32, sc *encodeScratch, s string, limit int) ([]uint32, bool) {
	start := len(dst)
	sc.keys, sc.marks = sc.keys[:0], sc.marks[:0]
	// NFC cuts at an ASCII byte only in valid UTF-8 (normalize.go).
	resumable := t.resumable && t.scan != nil && (t.normalizer == nil || utf8.ValidString(s))
	from := 0
	if resumable {
		sc.keys = t.cache.prefixHashes(sc.keys, s)
		if e, m, found := t.cache.resume(s, sc.keys); found {
			dst = append(dst, e.ids[:m.n]...)
			sc.marks = append(sc.marks, e.marks[:sort.Search(len(e.marks), func(i int) bool { return e.marks[i].off > m.off })]...)
			from = int(m.off)
			t.cache.stats.resumed.Inc()
			t.cache.stats.ResumedBytes.Add(float64(from))
		}
	}
	if from == 0 {
		t.cache.stats.miss.Inc()
	}
	if limit >= 0 && len(dst) > limit {
		return dst, false
	}
	ok := true
	if !resumable {
		dst, ok = t.encodeSegment(dst, sc, s, limit)
	} else if rest := s[from:]; t.normalizer != nil && t.normalizer.normalize(rest) != rest {
		// Marks hold only where the text is its own normal form: keep
		// those before from, encode the rest as usual.
		dst, ok = t.encodeSegment(dst, sc, rest, limit)
	} else {
		dst, ok = t.encodeMarked(dst, sc, s, from, start, limit)
	}
	// A stretch resumed for all but a small tail is not stored: it would
	// be a near copy of the entry it came from (a new question after the
	// same document each time), and copying it costs about as much as
	// resuming it again; the cache keeps room for other prefixes.
	if ok && (from == 0 || len(s)-from > len(s)/resumeStoreFraction) {
		t.cache.put(s, dst[start:], sc.marks, sc.keys)
	}
	return dst, ok
}

// encodeMarked is encodePlain's scanner walk over s[from:] (s needing no
// normalization) that also records resume marks in sc.marks: match starts
// at an ASCII byte that is not white space, at least markGap bytes apart;
// base is where s's ids start in dst.
func (t *Tokenizer) encodeMarked(dst []uint32, sc *encodeScratch, s string, from, base, limit int) ([]uint32, bool) {
	last := 0 // a mark at 0 would save nothing
	if n := len(sc.marks); n > 0 {
		last = int(sc.marks[n-1].off)
	}
	for i := from; i < len(s); {
		if c := s[i]; i-last >= markGap && c < utf8.RuneSelf && asciiClass[c] != clsSpace {
			sc.marks = append(sc.marks, mark{off: uint32(i), n: uint32(len(dst) - base)})
			last = i
		}
		end := t.scan.matchAt(s, i)
		dst = t.model.encodeWord(dst, s[i:end])
		if limit >= 0 && len(dst) > limit {
			return dst, false
		}
		i = end
	}
	return dst, true
}

// encodeSegment encodes one stretch of text between added tokens; false
// once len(dst) passes limit (limit < 0: no bound).
func (t *Tokenizer) encodeSegment(dst []uint32, sc *encodeScratch, s string, limit int) ([]uint32, bool) {
	if t.normalizer == nil {
		return t.encodePlain(dst, sc, s, limit)
	}
	s = t.normalizer.normalize(s)
	sc.nsegs = t.normMatch.split(sc.nsegs[:0], t.added, s, 0, len(s))
	ok := true
	for _, ns := range sc.nsegs {
		if ns.added {
			dst = append(dst, ns.id)
		} else {
			dst, ok = t.encodePlain(dst, sc, s[ns.start:ns.end], limit)
		}
		if !ok || limit >= 0 && len(dst) > limit {
			return dst, false
		}
	}
	return dst, true
}

// maxPooledScratch bounds the scratch kept for reuse: one huge prompt must
// not pin its working set in the pool after it is done.
const maxPooledScratch = 1 << 16

func (t *Tokenizer) putScratch(sc *encodeScratch) {
	if cap(sc.segs) > maxPooledScratch || cap(sc.nsegs) > maxPooledScratch || cap(sc.pieces) > maxPooledScratch ||
		cap(sc.keys) > maxPooledScratch || cap(sc.marks) > maxPooledScratch {
		return
	}
	t.pool.Put(sc)
}

func (t *Tokenizer) encodePlain(dst []uint32, sc *encodeScratch, s string, limit int) ([]uint32, bool) {
	if s == "" {
		return dst, true
	}
	if t.pre == nil {
		dst = t.model.encodeWord(dst, s)
		return dst, limit < 0 || len(dst) <= limit
	}
	if t.scan != nil {
		for i := 0; i < len(s); {
			end := t.scan.matchAt(s, i)
			dst = t.model.encodeWord(dst, s[i:end])
			if limit >= 0 && len(dst) > limit {
				return dst, false
			}
			i = end
		}
		return dst, true
	}
	sc.pieces = t.pre.split(sc.pieces[:0], s)
	ok := true
	for _, p := range sc.pieces {
		dst = t.model.encodeWord(dst, p)
		if limit >= 0 && len(dst) > limit {
			ok = false
			break
		}
	}
	clear(sc.pieces) // drop references to the input text
	return dst, ok
}

// Decode turns ids back into text, keeping special tokens, as HuggingFace
// decode(ids, skip_special_tokens=False). Unknown ids are skipped.
func (t *Tokenizer) Decode(ids []uint32) string {
	return t.decode(ids, false)
}

// DecodeSkipSpecial is Decode with skip_special_tokens=True.
func (t *Tokenizer) DecodeSkipSpecial(ids []uint32) string {
	return t.decode(ids, true)
}

func (t *Tokenizer) decode(ids []uint32, skipSpecial bool) string {
	var raw []byte
	for _, id := range ids {
		if skipSpecial && t.specialIDs[id] {
			continue
		}
		raw = append(raw, t.decodeTab[id]...)
	}
	return t.decoder.finish(raw)
}
