package tokenizer

import (
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// DefaultDir is where the daemon looks for staged tokenizers unless
// --tokenizer-dir says otherwise.
const DefaultDir = "/etc/loxilb/tokenizers"

// Sentinel errors returned (wrapped in *RegistryError) by Registry.Get.
// Callers branch on them with errors.Is.
var (
	// ErrNotStaged: DIR/<slug>/tokenizer.json does not exist.
	ErrNotStaged = errors.New("tokenizer not staged")
	// ErrUnreadable: the file exists but cannot be read (permissions, I/O).
	ErrUnreadable = errors.New("tokenizer unreadable")
	// ErrInvalid: the files were read but are not a usable tokenizer.
	ErrInvalid = errors.New("tokenizer invalid")
	// ErrInvalidModelName: the model name cannot name a directory safely.
	ErrInvalidModelName = errors.New("invalid model name")
)

// RegistryError says which model's tokenizer is unavailable, where it was
// looked for and why. errors.Is matches both the sentinel kind and the
// underlying cause.
type RegistryError struct {
	Model string
	Slug  string
	Path  string
	Kind  error // one of the sentinels above
	Err   error // the underlying cause
}

func (e *RegistryError) Error() string {
	return fmt.Sprintf("tokenizer for model %q (%s): %v: %v", e.Model, e.Path, e.Kind, e.Err)
}

// Unwrap exposes the sentinel and the cause.
func (e *RegistryError) Unwrap() []error { return []error{e.Kind, e.Err} }

// reasonOf maps an error kind to the metric/status label.
func reasonOf(kind error) string {
	switch {
	case errors.Is(kind, ErrNotStaged):
		return "not_staged"
	case errors.Is(kind, ErrUnreadable):
		return "unreadable"
	case errors.Is(kind, ErrInvalid):
		return "invalid"
	case errors.Is(kind, ErrInvalidModelName):
		return "invalid_model_name"
	}
	return "unknown"
}

// Slug is the directory name for a served model name: every "/" becomes
// "__". Case is preserved.
func Slug(model string) string { return strings.ReplaceAll(model, "/", "__") }

// ModelStatus is one row of the registry's capability report.
type ModelStatus struct {
	Model    string    `json:"model"`
	Slug     string    `json:"slug"`
	Path     string    `json:"path"`
	Loaded   bool      `json:"loaded"`
	Reason   string    `json:"reason,omitempty"` // not_staged, unreadable, invalid, ... when not loaded
	Error    string    `json:"error,omitempty"`
	LoadedAt time.Time `json:"loaded_at,omitzero"`
}

// RegistryOption tunes a Registry.
type RegistryOption func(*Registry)

// WithRecheckInterval sets how long a successful load is trusted before the
// files are stat'ed again for changes (default 2s). Failed lookups always
// re-stat, so a newly staged tokenizer is picked up on the next request.
func WithRecheckInterval(d time.Duration) RegistryOption {
	return func(r *Registry) { r.recheck = d }
}

// WithCacheBytes bounds each loaded tokenizer's prefix cache (the ids of
// recent prompt segments, resumable from a shared prefix; prefixcache.go)
// to n bytes; 0 turns it off. Default DefaultCacheBytes.
func WithCacheBytes(n int64) RegistryOption {
	return func(r *Registry) { r.cacheBytes = max(n, 0) }
}

// WithClock replaces time.Now (tests).
func WithClock(now func() time.Time) RegistryOption {
	return func(r *Registry) { r.now = now }
}

// Registry hands out tokenizers by served model name from files staged
// under a directory (DIR/<slug>/tokenizer.json, optional
// tokenizer_config.json and config.json). Files staged or replaced after
// start are picked up without a restart; a missing or broken tokenizer is reported with a
// reason, counted, and listed by Status, never silently skipped.
// A Registry is safe for concurrent use.
type Registry struct {
	dir     string
	log     *slog.Logger
	recheck time.Duration
	now     func() time.Time

	failures *prometheus.CounterVec
	loads    *prometheus.CounterVec
	loaded   prometheus.Gauge

	cacheBytes int64
	cacheStats *CacheMetrics // shared by every tokenizer the registry loads

	mu      sync.Mutex
	entries map[string]*regEntry // by slug
	pinned  map[string]bool      // slugs of the models rules name (Pin)

	sole soleCache // SoleModel
}

type regEntry struct {
	model string
	slug  string
	path  string

	mu        sync.Mutex // serialises loads of this model
	stamp     fileStamp
	checkedAt time.Time
	tok       *Tokenizer
	err       *RegistryError
	loadedAt  time.Time
}

// fileStamp identifies a version of the staged files.
type fileStamp struct {
	tokSize, cfgSize, modelSize    int64
	tokMTime, cfgMTime, modelMTime time.Time
	cfgPresent, modelPresent       bool
}

// NewRegistry creates a registry over dir. The directory need not exist
// yet: lookups report ErrNotStaged until files appear.
func NewRegistry(dir string, logger *slog.Logger, reg prometheus.Registerer, opts ...RegistryOption) (*Registry, error) {
	if dir == "" {
		return nil, fmt.Errorf("tokenizer registry: empty directory")
	}
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}
	r := &Registry{
		dir:        dir,
		log:        logger,
		recheck:    2 * time.Second,
		now:        time.Now,
		entries:    map[string]*regEntry{},
		cacheBytes: DefaultCacheBytes,
		cacheStats: NewCacheMetrics(),
		failures: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "loxilb_tokenizer_lookup_failures_total",
			Help: "Tokenizer lookups that returned no tokenizer, by reason (not_staged, unreadable, invalid, invalid_model_name).",
		}, []string{"reason"}),
		loads: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "loxilb_tokenizer_loads_total",
			Help: "Tokenizer load attempts from the staging directory, by result (ok or a failure reason).",
		}, []string{"result"}),
		loaded: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "loxilb_tokenizer_loaded",
			Help: "Number of tokenizers currently loaded.",
		}),
	}
	for _, o := range opts {
		o(r)
	}
	if reg != nil {
		for _, c := range append([]prometheus.Collector{r.failures, r.loads, r.loaded}, r.cacheStats.Collectors()...) {
			if err := reg.Register(c); err != nil {
				return nil, fmt.Errorf("tokenizer registry: register metrics: %w", err)
			}
		}
	}
	// Pre-create the reason series so dashboards see zeros, not gaps.
	for _, k := range []error{ErrNotStaged, ErrUnreadable, ErrInvalid, ErrInvalidModelName} {
		r.failures.WithLabelValues(reasonOf(k))
	}
	return r, nil
}

// Dir returns the staging directory.
func (r *Registry) Dir() string { return r.dir }

// Get returns the tokenizer for a served model name. Errors are
// *RegistryError wrapping ErrNotStaged, ErrUnreadable, ErrInvalid or
// ErrInvalidModelName.
func (r *Registry) Get(model string) (*Tokenizer, error) {
	slug := Slug(model)
	if err := validSlug(slug); err != nil {
		re := &RegistryError{Model: model, Slug: slug, Path: r.dir, Kind: ErrInvalidModelName, Err: err}
		r.failures.WithLabelValues(reasonOf(re.Kind)).Inc()
		return nil, re
	}
	e := r.existing(slug)
	if e == nil {
		// A client may name any model. Only a staged tokenizer or a
		// model a rule names gets an entry, so the entries, the status
		// report and the log stay bounded by what the operator put there.
		if re := r.probe(model, slug); re != nil && !r.isPinned(slug) {
			r.failures.WithLabelValues(reasonOf(re.Kind)).Inc()
			return nil, re
		}
		e = r.entry(model, slug)
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	now := r.now()
	if e.tok != nil && now.Sub(e.checkedAt) < r.recheck {
		return e.tok, nil
	}
	e.checkedAt = now
	stamp, statErr := r.stat(e)
	switch {
	case statErr != nil:
		r.setFailure(e, statErr)
	case e.tok != nil && stamp == e.stamp:
		// unchanged
	case e.tok == nil && e.err != nil && stamp == e.stamp && errors.Is(e.err.Kind, ErrInvalid):
		// Same broken files as last time: do not re-parse on every request.
	default:
		r.load(e, stamp)
	}
	if e.err != nil {
		r.failures.WithLabelValues(reasonOf(e.err.Kind)).Inc()
		return nil, e.err
	}
	return e.tok, nil
}

func validSlug(slug string) error {
	switch {
	case slug == "":
		return errors.New("empty model name")
	case slug == "." || slug == "..":
		return fmt.Errorf("model name %q is a relative directory", slug)
	case strings.ContainsAny(slug, "\\\x00"):
		return errors.New("model name contains a backslash or NUL")
	case len(slug) > 255:
		return errors.New("model name longer than 255 bytes")
	}
	return nil
}

func (r *Registry) existing(slug string) *regEntry {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.entries[slug]
}

func (r *Registry) isPinned(slug string) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.pinned[slug]
}

// probe reports why a model that has no entry cannot have a tokenizer
// (nil: its tokenizer.json exists), without keeping anything.
func (r *Registry) probe(model, slug string) *RegistryError {
	_, err := r.stat(&regEntry{model: model, slug: slug, path: filepath.Join(r.dir, slug)})
	return err
}

// Pin names the models the rules serve (their model_name). A pinned model
// keeps an entry, and so a row in Status with the reason it is not
// loaded, even while its tokenizer is not staged; any other name gets an
// entry only once its tokenizer.json exists. Pin replaces the previous
// set and drops entries of models no longer pinned whose tokenizer never
// loaded and is not staged.
func (r *Registry) Pin(models []string) {
	next := make(map[string]bool, len(models))
	for _, m := range models {
		if slug := Slug(m); validSlug(slug) == nil {
			next[slug] = true
		}
	}
	r.mu.Lock()
	r.pinned = next
	var check []*regEntry
	for slug, e := range r.entries {
		if !next[slug] {
			check = append(check, e)
		}
	}
	r.mu.Unlock()
	for _, e := range check {
		e.mu.Lock()
		drop := e.tok == nil && e.err != nil && errors.Is(e.err.Kind, ErrNotStaged)
		e.mu.Unlock()
		if drop {
			r.mu.Lock()
			if !r.pinned[e.slug] && r.entries[e.slug] == e {
				delete(r.entries, e.slug)
			}
			r.mu.Unlock()
		}
	}
}

func (r *Registry) entry(model, slug string) *regEntry {
	r.mu.Lock()
	defer r.mu.Unlock()
	e, ok := r.entries[slug]
	if !ok {
		e = &regEntry{model: model, slug: slug, path: filepath.Join(r.dir, slug)}
		r.entries[slug] = e
	}
	return e
}

// stat fingerprints the staged files; a stat failure is classified.
func (r *Registry) stat(e *regEntry) (fileStamp, *RegistryError) {
	var st fileStamp
	tokPath := filepath.Join(e.path, "tokenizer.json")
	fi, err := os.Stat(tokPath)
	if err != nil {
		kind := ErrUnreadable
		if errors.Is(err, fs.ErrNotExist) {
			kind = ErrNotStaged
		}
		return st, &RegistryError{Model: e.model, Slug: e.slug, Path: tokPath, Kind: kind, Err: err}
	}
	if !fi.Mode().IsRegular() {
		return st, &RegistryError{Model: e.model, Slug: e.slug, Path: tokPath, Kind: ErrUnreadable, Err: errors.New("not a regular file")}
	}
	st.tokSize, st.tokMTime = fi.Size(), fi.ModTime()
	cfgPath := filepath.Join(e.path, "tokenizer_config.json")
	if fi, err := os.Stat(cfgPath); err == nil {
		st.cfgPresent, st.cfgSize, st.cfgMTime = true, fi.Size(), fi.ModTime()
	} else if !errors.Is(err, fs.ErrNotExist) {
		return st, &RegistryError{Model: e.model, Slug: e.slug, Path: cfgPath, Kind: ErrUnreadable, Err: err}
	}
	modelPath := filepath.Join(e.path, "config.json") // the context length
	if fi, err := os.Stat(modelPath); err == nil {
		st.modelPresent, st.modelSize, st.modelMTime = true, fi.Size(), fi.ModTime()
	} else if !errors.Is(err, fs.ErrNotExist) {
		return st, &RegistryError{Model: e.model, Slug: e.slug, Path: modelPath, Kind: ErrUnreadable, Err: err}
	}
	return st, nil
}

func (r *Registry) load(e *regEntry, stamp fileStamp) {
	tok, err := Load(e.path)
	if err != nil {
		kind := ErrInvalid
		var pe *fs.PathError
		if errors.As(err, &pe) {
			kind = ErrUnreadable
			if errors.Is(err, fs.ErrNotExist) {
				kind = ErrNotStaged
			}
		}
		r.setFailure(e, &RegistryError{Model: e.model, Slug: e.slug, Path: e.path, Kind: kind, Err: err})
		e.stamp = stamp
		return
	}
	tok.cache.configure(r.cacheBytes, r.cacheStats) // before anyone encodes with it
	if e.tok == nil {
		r.loaded.Inc()
	}
	e.tok, e.err, e.stamp, e.loadedAt = tok, nil, stamp, r.now()
	r.loads.WithLabelValues("ok").Inc()
	r.log.Info("tokenizer loaded", "model", e.model, "path", e.path, "chat_template", tok.HasChatTemplate())
}

func (r *Registry) setFailure(e *regEntry, re *RegistryError) {
	changed := e.err == nil || e.err.Error() != re.Error()
	if e.tok != nil {
		// Files changed into something unusable: stop serving the old
		// tokenizer, whose ids may no longer match the engine's.
		r.loaded.Dec()
		e.tok = nil
	}
	e.err = re
	e.stamp = fileStamp{}
	if changed {
		r.loads.WithLabelValues(reasonOf(re.Kind)).Inc()
		r.log.Warn("tokenizer unavailable", "model", e.model, "path", re.Path, "reason", reasonOf(re.Kind), "err", re.Err)
	}
}

// Status lists every model with an entry (staged and looked up, or
// pinned) plus every directory staged under the registry directory, with whether its tokenizer is loaded and,
// if not, why. Directories never requested are listed as not loaded with
// reason "not_requested" (they load lazily on first use).
func (r *Registry) Status() []ModelStatus {
	r.mu.Lock()
	entries := make([]*regEntry, 0, len(r.entries))
	seen := map[string]bool{}
	for slug, e := range r.entries {
		entries = append(entries, e)
		seen[slug] = true
	}
	r.mu.Unlock()
	out := make([]ModelStatus, 0, len(entries))
	for _, e := range entries {
		e.mu.Lock()
		st := ModelStatus{Model: e.model, Slug: e.slug, Path: filepath.Join(e.path, "tokenizer.json"), Loaded: e.tok != nil, LoadedAt: e.loadedAt}
		if e.err != nil {
			st.Reason, st.Error = reasonOf(e.err.Kind), e.err.Error()
		}
		if e.tok == nil && e.err == nil {
			st.Reason = "not_requested"
		}
		e.mu.Unlock()
		out = append(out, st)
	}
	if des, err := os.ReadDir(r.dir); err == nil {
		for _, de := range des {
			if !de.IsDir() || seen[de.Name()] {
				continue
			}
			st := ModelStatus{Model: strings.ReplaceAll(de.Name(), "__", "/"), Slug: de.Name(), Path: filepath.Join(r.dir, de.Name(), "tokenizer.json"), Reason: "not_requested"}
			if _, err := os.Stat(st.Path); err != nil {
				st.Reason = "not_staged"
				st.Error = err.Error()
			}
			out = append(out, st)
		}
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Slug < out[j].Slug })
	return out
}

// LoadAll loads every tokenizer staged under the registry directory now,
// rather than on each model's first request (loading a 10 MB
// tokenizer.json takes a fraction of a second). Directory names are taken
// as slugs; the model name reported is the slug with "__" turned back into
// "/". It returns the resulting status; failures are logged and counted as
// in Get.
func (r *Registry) LoadAll() []ModelStatus {
	des, err := os.ReadDir(r.dir)
	if err != nil {
		r.log.Warn("tokenizer directory unreadable", "dir", r.dir, "err", err)
		return r.Status()
	}
	for _, de := range des {
		if !de.IsDir() {
			continue
		}
		model := strings.ReplaceAll(de.Name(), "__", "/")
		if Slug(model) != de.Name() {
			continue // names like "a___b" have no unambiguous model name
		}
		_, _ = r.Get(model)
	}
	return r.Status()
}
