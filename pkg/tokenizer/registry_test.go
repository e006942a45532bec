package tokenizer

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
)

type fakeClock struct {
	mu sync.Mutex
	t  time.Time
}

func (c *fakeClock) now() time.Time { c.mu.Lock(); defer c.mu.Unlock(); return c.t }
func (c *fakeClock) add(d time.Duration) {
	c.mu.Lock()
	c.t = c.t.Add(d)
	c.mu.Unlock()
}

func TestSlug(t *testing.T) {
	for in, want := range map[string]string{
		"Qwen/Qwen3-0.6B":       "Qwen__Qwen3-0.6B",
		"meta-llama/Llama-3-8B": "meta-llama__Llama-3-8B",
		"org/sub/Model":         "org__sub__Model",
		"plain":                 "plain",
		"Case/MiXed":            "Case__MiXed",
	} {
		if got := Slug(in); got != want {
			t.Errorf("Slug(%q) = %q, want %q", in, got, want)
		}
	}
}

func TestRegistryLifecycle(t *testing.T) {
	dir := t.TempDir()
	reg := prometheus.NewPedanticRegistry()
	clk := &fakeClock{t: time.Unix(1000, 0)}
	r, err := NewRegistry(dir, nil, reg, WithClock(clk.now), WithRecheckInterval(time.Second))
	if err != nil {
		t.Fatal(err)
	}
	model := "acme/tiny-1"
	_, err = r.Get(model)
	var re *RegistryError
	if !errors.Is(err, ErrNotStaged) || !errors.As(err, &re) || re.Slug != "acme__tiny-1" {
		t.Fatalf("want ErrNotStaged with slug, got %v", err)
	}
	if got := testutil.ToFloat64(r.failures.WithLabelValues("not_staged")); got != 1 {
		t.Fatalf("not_staged failures = %v", got)
	}
	// A name no rule serves and no directory holds leaves nothing behind.
	if st := r.Status(); len(st) != 0 {
		t.Fatalf("status after an unstaged lookup: %+v", st)
	}
	// A rule's model is reported while its tokenizer is missing.
	r.Pin([]string{model})
	if _, err := r.Get(model); !errors.Is(err, ErrNotStaged) {
		t.Fatalf("pinned, unstaged: %v", err)
	}
	st := r.Status()
	if len(st) != 1 || st[0].Loaded || st[0].Reason != "not_staged" {
		t.Fatalf("status %+v", st)
	}

	// Staged after start: picked up on the next lookup, no restart.
	mdir := filepath.Join(dir, "acme__tiny-1")
	if err := os.MkdirAll(mdir, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(mdir, "tokenizer.json"), minimalTokenizerJSON, 0o644); err != nil {
		t.Fatal(err)
	}
	tk, err := r.Get(model)
	if err != nil {
		t.Fatal(err)
	}
	if got := tk.Encode("ab", true); !equalIDs(got, []uint32{5, 2}) {
		t.Fatalf("encode %v", got)
	}
	if tk2, _ := r.Get(model); tk2 != tk {
		t.Fatal("tokenizer not cached")
	}
	if st := r.Status(); !st[0].Loaded || st[0].Reason != "" {
		t.Fatalf("status %+v", st)
	}
	if got := testutil.ToFloat64(r.loaded); got != 1 {
		t.Fatalf("loaded gauge %v", got)
	}

	// Replaced with garbage: reported as invalid after the recheck interval.
	time.Sleep(10 * time.Millisecond) // distinct mtime on coarse filesystems
	if err := os.WriteFile(filepath.Join(mdir, "tokenizer.json"), []byte(`{"model": {"type": "Unigram"}} `), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := r.Get(model); err != nil {
		t.Fatalf("within recheck interval the loaded tokenizer is served: %v", err)
	}
	clk.add(2 * time.Second)
	if _, err := r.Get(model); !errors.Is(err, ErrInvalid) {
		t.Fatalf("want ErrInvalid, got %v", err)
	}
	if got := testutil.ToFloat64(r.loaded); got != 0 {
		t.Fatalf("loaded gauge %v after invalid replacement", got)
	}
	if got := testutil.ToFloat64(r.loads.WithLabelValues("invalid")); got != 1 {
		t.Fatalf("invalid loads %v", got)
	}
	// Same broken file again: not re-parsed, but every lookup is counted.
	if _, err := r.Get(model); !errors.Is(err, ErrInvalid) {
		t.Fatal(err)
	}
	if got := testutil.ToFloat64(r.loads.WithLabelValues("invalid")); got != 1 {
		t.Fatalf("broken file re-parsed: invalid loads %v", got)
	}
	if got := testutil.ToFloat64(r.failures.WithLabelValues("invalid")); got != 2 {
		t.Fatalf("invalid failures %v", got)
	}

	// Unreadable: tokenizer.json is a directory.
	other := filepath.Join(dir, "acme__weird")
	if err := os.MkdirAll(filepath.Join(other, "tokenizer.json"), 0o755); err != nil {
		t.Fatal(err)
	}
	if _, err := r.Get("acme/weird"); !errors.Is(err, ErrUnreadable) {
		t.Fatalf("want ErrUnreadable, got %v", err)
	}
	// Bad model names never touch the filesystem outside dir.
	for _, bad := range []string{"", "..", ".", "a\\b"} {
		if _, err := r.Get(bad); !errors.Is(err, ErrInvalidModelName) {
			t.Errorf("Get(%q): want ErrInvalidModelName, got %v", bad, err)
		}
	}
	// A staged directory never requested still shows up.
	if err := os.MkdirAll(filepath.Join(dir, "org__unused"), 0o755); err != nil {
		t.Fatal(err)
	}
	found := false
	for _, s := range r.Status() {
		if s.Slug == "org__unused" {
			found = s.Model == "org/unused" && !s.Loaded && s.Reason == "not_staged"
		}
	}
	if !found {
		t.Fatalf("unrequested directory missing from status: %+v", r.Status())
	}
	if _, err := NewRegistry(dir, nil, reg); err == nil {
		t.Fatal("duplicate metric registration not reported")
	}
}

func TestRegistryConcurrentGet(t *testing.T) {
	r, err := NewRegistry(stagedDir, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	toks := make([]*Tokenizer, 4)
	for i := range toks {
		wg.Add(1)
		go func() {
			defer wg.Done()
			tk, err := r.Get("Qwen/Qwen3-0.6B")
			if err != nil {
				t.Error(err)
				return
			}
			toks[i] = tk
		}()
	}
	wg.Wait()
	for _, tk := range toks[1:] {
		if tk != toks[0] {
			t.Fatal("concurrent lookups loaded the tokenizer more than once")
		}
	}
}

func TestRegistryLoadAll(t *testing.T) {
	dir := t.TempDir()
	for _, slug := range []string{"org__good", "org__broken"} {
		if err := os.MkdirAll(filepath.Join(dir, slug), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.WriteFile(filepath.Join(dir, "org__good", "tokenizer.json"), minimalTokenizerJSON, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "org__broken", "tokenizer.json"), []byte("{"), 0o644); err != nil {
		t.Fatal(err)
	}
	r, err := NewRegistry(dir, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	st := r.LoadAll()
	if len(st) != 2 {
		t.Fatalf("status %+v", st)
	}
	byModel := map[string]ModelStatus{}
	for _, s := range st {
		byModel[s.Model] = s
	}
	if !byModel["org/good"].Loaded || byModel["org/broken"].Loaded || byModel["org/broken"].Reason != "invalid" {
		t.Fatalf("status %+v", st)
	}
	if _, err := NewRegistry("", nil, nil); err == nil {
		t.Fatal("empty dir accepted")
	}
}

// TestRegistryUnknownNamesLeaveNoState: every model name a client sends
// reaches Get. Names with no staged tokenizer must not become entries
// (each kept the name, its error and a Status row, forever); a pinned
// name does, and unpinning an unstaged one drops it.
func TestRegistryUnknownNamesLeaveNoState(t *testing.T) {
	dir := t.TempDir()
	mdir := filepath.Join(dir, "org__staged")
	if err := os.MkdirAll(mdir, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(mdir, "tokenizer.json"), minimalTokenizerJSON, 0o644); err != nil {
		t.Fatal(err)
	}
	r, err := NewRegistry(dir, nil, prometheus.NewPedanticRegistry())
	if err != nil {
		t.Fatal(err)
	}
	for i := range 5000 {
		if _, err := r.Get(fmt.Sprintf("client/model-%d", i)); !errors.Is(err, ErrNotStaged) {
			t.Fatalf("unknown name %d: %v", i, err)
		}
	}
	if _, err := r.Get(strings.Repeat("x", 1<<20)); !errors.Is(err, ErrInvalidModelName) {
		t.Fatalf("1 MiB name: %v", err)
	}
	if _, err := r.Get("org/staged"); err != nil {
		t.Fatal(err)
	}
	r.mu.Lock()
	n := len(r.entries)
	r.mu.Unlock()
	if n != 1 {
		t.Fatalf("%d registry entries after 5,001 unknown names and one staged one, want 1", n)
	}
	if st := r.Status(); len(st) != 1 || st[0].Model != "org/staged" || !st[0].Loaded {
		t.Fatalf("status %+v", st)
	}
	if got := testutil.ToFloat64(r.failures.WithLabelValues("not_staged")); got != 5000 {
		t.Fatalf("not_staged failures = %v, want 5000", got)
	}
	r.Pin([]string{"rule/model"})
	_, _ = r.Get("rule/model")
	if st := r.Status(); len(st) != 2 {
		t.Fatalf("pinned model missing from status: %+v", st)
	}
	r.Pin(nil)
	if st := r.Status(); len(st) != 1 {
		t.Fatalf("unpinned, unstaged model still listed: %+v", st)
	}
}

// TestRegistryPicksUpModelConfig: a config.json staged next to a loaded
// tokenizer changes its context length once the files are rechecked.
func TestRegistryPicksUpModelConfig(t *testing.T) {
	dir := t.TempDir()
	mdir := filepath.Join(dir, "m")
	if err := os.MkdirAll(mdir, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(mdir, "tokenizer.json"), minimalTokenizerJSON, 0o644); err != nil {
		t.Fatal(err)
	}
	clk := &fakeClock{t: time.Unix(1000, 0)}
	r, err := NewRegistry(dir, nil, nil, WithClock(clk.now), WithRecheckInterval(time.Second))
	if err != nil {
		t.Fatal(err)
	}
	tk, err := r.Get("m")
	if err != nil || tk.MaxLength() != 0 {
		t.Fatalf("%v %v", tk, err)
	}
	if err := os.WriteFile(filepath.Join(mdir, "config.json"), []byte(`{"max_position_embeddings": 4096}`), 0o644); err != nil {
		t.Fatal(err)
	}
	clk.add(2 * time.Second)
	if tk, err = r.Get("m"); err != nil || tk.MaxLength() != 4096 {
		t.Fatalf("after staging config.json: %v %v", tk.MaxLength(), err)
	}
}
