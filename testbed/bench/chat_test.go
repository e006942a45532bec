package bench

import (
	"path/filepath"
	"testing"

	"github.com/loxilb-llm/loxilb/pkg/tokenizer"
)

func sharedPrefix(a, b []uint32) int {
	n := 0
	for n < len(a) && n < len(b) && a[n] == b[n] {
		n++
	}
	return n
}

// The chat workloads render through the model's real template: every
// request tokenizes, requests on one document share the document, and an
// agent's step extends the previous step's prompt, so a KV router has
// something to find and the fleet-LRU bound something to count.
func TestChatWorkloadsTokenize(t *testing.T) {
	root, err := FindRepoRoot(".")
	if err != nil {
		t.Fatal(err)
	}
	tok, err := tokenizer.Load(filepath.Join(DefaultTokenizerDir(root), tokenizer.Slug(Model)))
	if err != nil {
		t.Fatal(err)
	}
	for _, engine := range []string{"vllm", "sglang"} {
		f, _ := FleetFor(engine)
		for _, w := range ChatWorkloads(7, f) {
			if err := tokenizeChat(&w, tok, engine); err != nil {
				t.Fatal(err)
			}
			byGroup := map[int][]uint32{}
			total, unique := 0, 0
			for _, s := range w.Streams {
				for k, r := range s.Reqs {
					total += len(r.Tokens)
					if len(r.Tokens) < 200 {
						t.Fatalf("%s/%s: a %d-token prompt", engine, w.Name, len(r.Tokens))
					}
					if r.Group < 0 {
						unique++
						continue
					}
					if prev, ok := byGroup[r.Group]; ok {
						// Same document or the agent's earlier step: all of it
						// but the last turn's template tail is a prefix.
						if n := sharedPrefix(prev, r.Tokens); n < len(prev)-64 && n < 1000 {
							t.Fatalf("%s/%s group %d request %d shares %d of %d tokens with the previous one", engine, w.Name, r.Group, k, n, len(prev))
						}
					}
					byGroup[r.Group] = r.Tokens
				}
			}
			b := UpperBound(w.Trace(), f)
			t.Logf("%s/%s: %d requests (%d one-shot), %d prompt tokens (mean %d), fleet-LRU bound %.3f, unbounded %.3f",
				engine, w.Name, w.Requests(), unique, total, total/w.Requests(), b.FleetLRU, b.Unbounded)
			if b.FleetLRU <= 0.2 {
				t.Errorf("%s/%s: bound %.3f leaves routing nothing to find", engine, w.Name, b.FleetLRU)
			}
		}
	}
}
