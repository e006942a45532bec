package kvevents

import (
	"strings"
	"testing"

	"github.com/loxilb-llm/loxilb/pkg/blockhash"
)

// vectorStoredEvents decodes the BlockStored events of a vector payload.
func vectorStoredEvents(t *testing.T, file, name string, order KeyOrder) []Event {
	t.Helper()
	_, _, p := loadEventVectors(t, file)[name].frames(t)
	var b Batch
	if err := NewDecoder(order).Decode(p, &b); err != nil {
		t.Fatal(err)
	}
	var out []Event
	for _, e := range b.Events {
		if e.Kind == KindStored {
			e.Hashes = append([]uint64(nil), e.Hashes...)
			e.Tokens = append([]uint32(nil), e.Tokens...)
			out = append(out, e)
		}
	}
	return out
}

func TestParityVerdicts(t *testing.T) {
	vllm := vectorStoredEvents(t, "vllm_event_vectors.json", "vllm_map_events_int_hashes", KeyLast8)
	sgl := vectorStoredEvents(t, "sglang_event_vectors.json", "sglang_tagged_array_events_rank0", KeyFirst8)
	cases := []struct {
		name    string
		spec    Spec
		events  []Event
		verdict string
		reason  string
	}{
		{"vllm matched", Spec{Engine: EngineVLLM, HashAlgo: "sha256_cbor", BlockSize: 16, Seed: "42"}, vllm, VerdictOK, "match"},
		{"vllm wrong seed", Spec{Engine: EngineVLLM, HashAlgo: "sha256_cbor", BlockSize: 16, Seed: "0"}, vllm, VerdictHashMismatch, "PYTHONHASHSEED"},
		{"vllm default seed", Spec{Engine: EngineVLLM, HashAlgo: "sha256_cbor", BlockSize: 16}, vllm, VerdictHashMismatch, `"vllm-none-hash"`},
		{"vllm wrong algo", Spec{Engine: EngineVLLM, HashAlgo: "xxhash_cbor", BlockSize: 16, Seed: "42"}, vllm, VerdictHashAlgoMismatch, "match sha256_cbor"},
		{"vllm wrong block size", Spec{Engine: EngineVLLM, HashAlgo: "sha256_cbor", BlockSize: 32, Seed: "42"}, vllm, VerdictBlockSizeMismatch, "16 tokens"},
		{"vllm xxhash without seed", Spec{Engine: EngineVLLM, HashAlgo: "xxhash_cbor", BlockSize: 16}, vllm, VerdictUnverified, "seed"},
		{"sglang matched", Spec{Engine: EngineSGLang, BlockSize: 16}, sgl, VerdictOK, "match"},
		{"sglang smaller rule block", Spec{Engine: EngineSGLang, BlockSize: 8}, sgl, VerdictBlockSizeMismatch, "16 tokens"},
		{"sglang read as vllm", Spec{Engine: EngineSGLang, HashAlgo: "sha256_cbor", BlockSize: 16}, sgl, VerdictHashMismatch, "sha256_cbor"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			var changes []string
			p := newParityTracker(tc.spec, 1024, func(old, v, r string) { changes = append(changes, v) })
			for i := range tc.events {
				p.observe(&tc.events[i], false)
			}
			st := p.status()
			if st.Verdict != tc.verdict || !strings.Contains(st.Reason, tc.reason) {
				t.Fatalf("verdict = %s (%s), want %s containing %q", st.Verdict, st.Reason, tc.verdict, tc.reason)
			}
			if tc.verdict != VerdictUnverified && len(changes) != 1 {
				t.Fatalf("verdict changes = %v, want exactly one", changes)
			}
		})
	}
}

// TestParitySGLangSmallPages: an engine with page size 1 against a rule of
// 16 publishes chained one-token pages; a short page that has a child
// cannot be a trailing partial page.
func TestParitySGLangSmallPages(t *testing.T) {
	h, err := blockhash.New(blockhash.Config{Algo: blockhash.SHA256SGLang, BlockSize: 1})
	if err != nil {
		t.Fatal(err)
	}
	p := newParityTracker(Spec{Engine: EngineSGLang, BlockSize: 16}, 1024, nil)
	var d blockhash.Digest
	var parent uint64
	for i := 0; i < 4; i++ {
		tok := []uint32{uint32(i + 1)}
		var k uint64
		d, k = h.Next(d, tok)
		e := Event{Kind: KindStored, Hashes: []uint64{k}, Tokens: tok, Parent: parent, HasParent: i > 0, BlockSize: 1}
		p.observe(&e, false)
		parent = k
	}
	if st := p.status(); st.Verdict != VerdictBlockSizeMismatch {
		t.Fatalf("verdict = %+v", st)
	}

	// A legitimate trailing partial page (parent is a full page) is fine.
	h16, _ := blockhash.New(blockhash.Config{Algo: blockhash.SHA256SGLang, BlockSize: 16})
	p = newParityTracker(Spec{Engine: EngineSGLang, BlockSize: 16}, 1024, nil)
	d0, k0 := h16.Next(blockhash.Digest{}, seqTokens(1, 16))
	_, k1 := h16.Next(d0, seqTokens(17, 5))
	full := Event{Kind: KindStored, Hashes: []uint64{k0}, Tokens: seqTokens(1, 16)}
	part := Event{Kind: KindStored, Hashes: []uint64{k1}, Tokens: seqTokens(17, 5), Parent: k0, HasParent: true}
	p.observe(&full, false)
	p.observe(&part, false)
	if st := p.status(); st.Verdict != VerdictOK || st.VerifiedBlocks != 1 {
		t.Fatalf("verdict = %+v", st)
	}
}

// TestParityChildChains: a child run is verified from the parent digest
// computed earlier; a child of an unknown parent proves nothing; non-plain
// events are skipped.
func TestParityChildChains(t *testing.T) {
	vllm := vectorStoredEvents(t, "vllm_event_vectors.json", "vllm_map_events_int_hashes", KeyLast8)
	p := newParityTracker(Spec{Engine: EngineVLLM, BlockSize: 16, Seed: "42"}, 1024, nil)
	p.observe(&vllm[1], false) // child first: parent digest unknown
	if st := p.status(); st.Verdict != VerdictUnverified || st.UnverifiableEvents != 1 {
		t.Fatalf("orphan = %+v", st)
	}
	p.observe(&vllm[0], false)
	p.observe(&vllm[1], false)
	if st := p.status(); st.Verdict != VerdictOK || st.VerifiedBlocks != 4 {
		t.Fatalf("chain = %+v", st)
	}
	salted := vllm[0]
	salted.HasExtraKeys = true
	salted.Hashes = []uint64{1, 2, 3}
	p.observe(&salted, false)
	if st := p.status(); st.Verdict != VerdictOK || st.UnverifiableEvents != 2 {
		t.Fatalf("non-plain = %+v", st)
	}
	// A wrong child key flips the verdict.
	bad := vllm[1]
	bad.Hashes = []uint64{12345}
	p.observe(&bad, false)
	if st := p.status(); st.Verdict != VerdictHashMismatch || !strings.Contains(st.Reason, "child") {
		t.Fatalf("bad child = %+v", st)
	}
}

// TestUntrustedVerdicts: only the three mismatch verdicts are untrusted;
// unverified is not (an engine that publishes no tokens is not accused).
func TestUntrustedVerdicts(t *testing.T) {
	for v, want := range map[string]bool{VerdictOK: false, VerdictUnverified: false, "": false,
		VerdictHashMismatch: true, VerdictBlockSizeMismatch: true, VerdictHashAlgoMismatch: true} {
		if Untrusted(v) != want {
			t.Errorf("Untrusted(%q) = %v", v, !want)
		}
	}
	var m Manager
	m.subs = map[subKey]*subscription{}
	if v := m.ParityVerdict(1, 0); v != "" {
		t.Errorf("no subscription: verdict %q", v)
	}
}
