package kvevents

import (
	"fmt"
	"sync"
	"time"

	"github.com/loxilb-llm/loxilb/pkg/blockhash"
)

// parityTracker attests that the rule's hash contract reproduces the keys an
// engine publishes. BlockStored events carry their tokens, so the gateway
// recomputes each block's key and compares: a root-anchored run (no parent)
// starts from the contract's root, and a child run starts from the digest the
// tracker computed for its parent earlier. Runs whose parent digest is
// unknown, or whose hash depends on more than tokens (LoRA, cache salt, extra
// keys), prove nothing and are counted as unverifiable.
//
// The verdict follows the latest evidence, so an engine relaunched with a
// different configuration flips it.
type parityTracker struct {
	engine string
	bs     int
	algo   blockhash.Algo
	// h is the rule's contract; alt is the other vLLM algorithm with the
	// same seed (to tell hash_algo_mismatch from hash_mismatch); either may
	// be nil when it cannot be built.
	h, alt   *blockhash.Hasher
	altAlgo  blockhash.Algo
	hashErr  string
	max      int
	onChange func(old, verdict, reason string)

	mu      sync.Mutex
	digests map[uint64]parityEntry
	st      ParityStatus
	events  uint64
}

type parityEntry struct {
	d blockhash.Digest
	// short marks an SGLang page with fewer tokens than the rule's block
	// size: legitimate as a trailing partial page, but never as a parent.
	short bool
}

// paritySampleAfter is the number of attested blocks after which only one
// event in paritySampleEvery is checked: the verdict is established (and
// still follows the sampled evidence), and hashing every block would cost
// more than decoding it.
const (
	paritySampleAfter = 4096
	paritySampleEvery = 16
)

func newParityTracker(spec Spec, maxDigests int, onChange func(old, verdict, reason string)) *parityTracker {
	p := &parityTracker{
		engine:   spec.Engine,
		bs:       spec.BlockSize,
		algo:     spec.algo(),
		max:      maxDigests,
		onChange: onChange,
		digests:  make(map[uint64]parityEntry),
		st:       ParityStatus{Verdict: VerdictUnverified, Reason: "no BlockStored event with tokens seen yet"},
	}
	h, err := newHasher(spec, p.algo)
	if err != nil {
		p.hashErr = err.Error()
		p.st.Reason = "cannot build the rule's hash contract: " + err.Error()
		return p
	}
	p.h = h
	switch p.algo {
	case blockhash.SHA256CBOR:
		p.altAlgo = blockhash.XXHashCBOR
	case blockhash.XXHashCBOR:
		p.altAlgo = blockhash.SHA256CBOR
	}
	if p.altAlgo != "" {
		// Without an explicit seed xxhash_cbor is random on the engine
		// too, so the alternative simply is not checked.
		p.alt, _ = newHasher(spec, p.altAlgo)
	}
	return p
}

func (p *parityTracker) status() ParityStatus {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.st
}

// forgetRank drops remembered digests after a publisher reset; they may
// belong to a previous engine process.
func (p *parityTracker) forgetRank() {
	p.mu.Lock()
	clear(p.digests)
	p.mu.Unlock()
}

// set records evidence. reason is only formatted when the verdict changes,
// so steady-state evidence costs no allocation (and logs nothing).
func (p *parityTracker) set(verdict string, reason func() string) {
	old := p.st.Verdict
	if old == verdict {
		return
	}
	p.st.Verdict, p.st.Reason = verdict, reason()
	p.st.Since = time.Now()
	if p.onChange != nil {
		p.onChange(old, verdict, p.st.Reason)
	}
}

func (p *parityTracker) remember(key uint64, e parityEntry) {
	if len(p.digests) >= p.max {
		clear(p.digests)
	}
	p.digests[key] = e
}

// attestation is what one observed event proved.
type attestation uint8

const (
	// attestNone: the event was not checked (sampled out, unverifiable,
	// or a geometry or algorithm mismatch, which is configuration rather
	// than forgery).
	attestNone attestation = iota
	// attestVerified: every key of the event recomputed from its tokens.
	attestVerified
	// attestForged: a key does not hash from its tokens under the rule's
	// contract (nor under the other vLLM algorithm).
	attestForged
)

// observe attests one BlockStored event of a vLLM or SGLang publisher.
// every disables sampling (a quarantined endpoint has every event checked).
func (p *parityTracker) observe(e *Event, every bool) attestation {
	if p.h == nil {
		return attestNone
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	p.events++
	if !every && p.st.VerifiedBlocks+p.st.MismatchedBlocks >= paritySampleAfter && p.events%paritySampleEvery != 0 {
		return attestNone
	}
	n := len(e.Hashes)
	if n == 0 || len(e.Tokens) == 0 || !e.Plain() || len(e.Tokens)%n != 0 {
		p.st.UnverifiableEvents++
		return attestNone
	}
	tpb := len(e.Tokens) / n
	short := false
	switch {
	case tpb > p.bs || (p.engine != EngineSGLang && tpb != p.bs):
		p.st.MismatchedBlocks += uint64(n)
		p.set(VerdictBlockSizeMismatch, func() string {
			return fmt.Sprintf("engine blocks hold %d tokens but the rule's kvBlockSize is %d", tpb, p.bs)
		})
		return attestNone
	case tpb < p.bs:
		// SGLang publishes a trailing partial page; it never has children.
		// A short page that is the parent of another page means the
		// engine's page size is smaller than the rule's.
		if e.HasParent {
			if pe, ok := p.digests[e.Parent]; ok && pe.short {
				p.st.MismatchedBlocks += uint64(n)
				p.set(VerdictBlockSizeMismatch, func() string {
					return fmt.Sprintf("engine pages hold %d tokens but the rule's kvBlockSize is %d", tpb, p.bs)
				})
				return attestNone
			}
		}
		short = true
	}
	var parent blockhash.Digest // zero: the contract's root
	if e.HasParent {
		pe, ok := p.digests[e.Parent]
		if !ok {
			p.st.UnverifiableEvents++
			return attestNone
		}
		parent = pe.d
	}
	d := parent
	for i := 0; i < n; i++ {
		var k uint64
		d, k = p.h.Next(d, e.Tokens[i*tpb:(i+1)*tpb])
		if k != e.Hashes[i] {
			p.st.MismatchedBlocks += uint64(n - i)
			if p.mismatch(e, tpb, i, k) {
				return attestNone
			}
			return attestForged
		}
		p.remember(k, parentEntry(d, short))
	}
	if short {
		// A partial page verifies the hash function but not the geometry;
		// its keys are still proven.
		return attestVerified
	}
	p.st.VerifiedBlocks += uint64(n)
	p.set(VerdictOK, func() string { return fmt.Sprintf("recomputed %s keys match the keys the engine publishes", p.algo) })
	return attestVerified
}

func parentEntry(d blockhash.Digest, short bool) parityEntry { return parityEntry{d: d, short: short} }

// mismatch classifies a key that did not reproduce. It reports whether the
// keys match the other vLLM algorithm (a configuration mismatch, not a
// forgery).
func (p *parityTracker) mismatch(e *Event, tpb, i int, got uint64) (otherAlgo bool) {
	if p.alt != nil && !e.HasParent && i == 0 {
		var d blockhash.Digest
		all := true
		for j := 0; j < len(e.Hashes); j++ {
			var k uint64
			d, k = p.alt.Next(d, e.Tokens[j*tpb:(j+1)*tpb])
			if k != e.Hashes[j] {
				all = false
				break
			}
		}
		if all {
			p.set(VerdictHashAlgoMismatch, func() string {
				return fmt.Sprintf("engine keys match %s, but the rule's kvHashAlgo is %s", p.altAlgo, p.algo)
			})
			return true
		}
	}
	p.set(VerdictHashMismatch, func() string { return p.mismatchReason(e, i, got) })
	return false
}

func (p *parityTracker) mismatchReason(e *Event, i int, got uint64) string {
	var why string
	switch p.engine {
	case EngineVLLM:
		why = fmt.Sprintf("with seed %q: the engine's PYTHONHASHSEED (NONE_HASH seed) or hash algorithm differs", p.h.Seed())
	case EngineSGLang:
		why = "the engine's page hash differs (version, salt or namespace)"
	default:
		why = "the engine's hash differs"
	}
	anchor := "root-anchored"
	if e.HasParent || i > 0 {
		anchor = "child"
	}
	return fmt.Sprintf("%s block key %d recomputed as %d under %s %s", anchor, e.Hashes[i], got, p.algo, why)
}

// observeTRT records evidence from the TensorRT-LLM path, where the gateway
// derives keys from event tokens itself: parity then only depends on the
// block geometry.
func (p *parityTracker) observeTRT(ok bool, tokens int) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if !ok {
		p.st.MismatchedBlocks++
		p.set(VerdictBlockSizeMismatch, func() string {
			return fmt.Sprintf("engine blocks hold %d tokens but the rule's kvBlockSize is %d", tokens, p.bs)
		})
		return
	}
	p.st.VerifiedBlocks++
	p.set(VerdictOK, func() string {
		return fmt.Sprintf("keys derived from event tokens with %s; block geometry matches", p.algo)
	})
}
