package tokenizer

import (
	"os"
	"path/filepath"
	"testing"
	"time"
)

func TestSoleModel(t *testing.T) {
	dir := t.TempDir()
	now := time.Unix(1000, 0)
	r, err := NewRegistry(dir, nil, nil, WithClock(func() time.Time { return now }))
	if err != nil {
		t.Fatal(err)
	}
	stage := func(slug string) {
		t.Helper()
		if err := os.MkdirAll(filepath.Join(dir, slug), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(dir, slug, "tokenizer.json"), []byte("{}"), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	if m, ok := r.SoleModel(); ok || m != "" {
		t.Fatalf("empty directory: %q %v", m, ok)
	}
	// A directory without tokenizer.json and a stray file do not count.
	_ = os.MkdirAll(filepath.Join(dir, "acme__empty"), 0o755)
	_ = os.WriteFile(filepath.Join(dir, "README.md"), nil, 0o644)
	stage("Qwen__Qwen3-0.6B")
	if m, ok := r.SoleModel(); ok {
		t.Fatalf("cached listing ignored: %q", m)
	}
	now = now.Add(3 * time.Second)
	if m, ok := r.SoleModel(); !ok || m != "Qwen/Qwen3-0.6B" {
		t.Fatalf("one staged: %q %v", m, ok)
	}
	stage("meta-llama__Llama-3.1-8B-Instruct")
	now = now.Add(3 * time.Second)
	if m, ok := r.SoleModel(); ok {
		t.Fatalf("two staged: %q, want none", m)
	}
}
