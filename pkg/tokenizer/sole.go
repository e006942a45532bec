package tokenizer

import (
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"
)

// soleCache remembers which models are staged, for SoleModel.
type soleCache struct {
	mu    sync.Mutex
	at    time.Time
	model string // "" unless exactly one model is staged
}

// maxScannedEntries bounds the directory entries SoleModel reads: a
// deployment that stages more is not a single-model deployment.
const maxScannedEntries = 4096

// SoleModel returns the model whose tokenizer is the only one staged under
// the directory (DIR/<slug>/tokenizer.json), ok=false when none or several
// are. A request that names no model (vLLM and SGLang serve it with the
// one model they run) is tokenized for that model. The listing is cached
// for the recheck interval, so such requests cost no system call in the
// steady state, and staging a second model turns it off within that time.
func (r *Registry) SoleModel() (string, bool) {
	c := &r.sole
	c.mu.Lock()
	defer c.mu.Unlock()
	now := r.now()
	if !c.at.IsZero() && now.Sub(c.at) < r.recheck {
		return c.model, c.model != ""
	}
	c.at, c.model = now, r.scanSole()
	return c.model, c.model != ""
}

// scanSole lists the staged models and returns the only one, or "".
func (r *Registry) scanSole() string {
	f, err := os.Open(r.dir)
	if err != nil {
		return ""
	}
	defer f.Close()
	des, err := f.ReadDir(maxScannedEntries)
	if err != nil && len(des) == 0 {
		return ""
	}
	if len(des) == maxScannedEntries {
		return ""
	}
	found := ""
	for _, de := range des {
		name := de.Name()
		if !de.IsDir() {
			continue
		}
		model := strings.ReplaceAll(name, "__", "/")
		if Slug(model) != name || validSlug(name) != nil {
			continue
		}
		if st, err := os.Stat(filepath.Join(r.dir, name, "tokenizer.json")); err != nil || !st.Mode().IsRegular() {
			continue
		}
		if found != "" {
			return "" // several: the request's model cannot be inferred
		}
		found = model
	}
	return found
}
