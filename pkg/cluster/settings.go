package cluster

import (
	"crypto/pbkdf2"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"sync"
)

// seedSalt separates the cluster's fingerprints from any other hash of
// the same seed (diagnostics print a different one).
const seedSalt = "loxilb cluster seed fingerprint v1"

// seedIterations makes each guess cost PBKDF2's work: engine seeds are
// often PYTHONHASHSEED integers (32 bits), which one plain SHA-256 would
// let anyone reading etcd or the API recover in seconds.
const seedIterations = 100_000

// SeedUnset is the fingerprint of an unset seed.
const SeedUnset = "unset"

// SeedFingerprint identifies a seed without revealing it: 16 hex digits
// of PBKDF2-HMAC-SHA256 over the seed with a fixed domain salt. Nodes with
// the same seed have the same fingerprint; the seed itself never leaves
// the process.
func SeedFingerprint(seed string) string {
	if seed == "" {
		return SeedUnset
	}
	k, err := pbkdf2.Key(sha256.New, seed, []byte(seedSalt), seedIterations, 8)
	if err != nil {
		// Only a FIPS-mode refusal of a short password gets here: the
		// fingerprint then still must not carry the seed.
		return "unavailable"
	}
	return hex.EncodeToString(k)
}

// MaxTokenizers bounds the staged models a node announces.
const MaxTokenizers = 256

// Tokenizers checksums the tokenizers staged under a directory
// (DIR/<slug>/tokenizer.json and tokenizer_config.json, the files that
// decide token ids and the chat template), recomputing a model's sum only
// when its files' size or modification time changed. Safe for concurrent
// use.
type Tokenizers struct {
	dir   string
	mu    sync.Mutex
	cache map[string]tokSum // by slug
}

type tokSum struct {
	stamp string
	sum   string
}

// NewTokenizers checksums the staging directory dir.
func NewTokenizers(dir string) *Tokenizers {
	return &Tokenizers{dir: dir, cache: map[string]tokSum{}}
}

// Settings returns TokenizerPrefix+model → checksum (16 hex digits of
// SHA-256) for every model staged now; a directory that cannot be read
// is left out (the tokenizer capability reports it).
func (t *Tokenizers) Settings() map[string]string {
	out := map[string]string{}
	if t == nil || t.dir == "" {
		return out
	}
	des, err := os.ReadDir(t.dir)
	if err != nil {
		return out
	}
	var slugs []string
	for _, de := range des {
		if de.IsDir() {
			slugs = append(slugs, de.Name())
		}
	}
	sort.Strings(slugs)
	t.mu.Lock()
	defer t.mu.Unlock()
	seen := map[string]bool{}
	for _, slug := range slugs {
		if len(out) == MaxTokenizers {
			break
		}
		sum, err := t.sum(slug)
		if err != nil {
			continue
		}
		seen[slug] = true
		out[TokenizerPrefix+strings.ReplaceAll(slug, "__", "/")] = sum
	}
	for slug := range t.cache {
		if !seen[slug] {
			delete(t.cache, slug)
		}
	}
	return out
}

var tokFiles = []string{"tokenizer.json", "tokenizer_config.json"}

// sum returns the slug's checksum from the cache while its files are
// unchanged.
func (t *Tokenizers) sum(slug string) (string, error) {
	var stamp strings.Builder
	for i, f := range tokFiles {
		fi, err := os.Stat(filepath.Join(t.dir, slug, f))
		switch {
		case err == nil && fi.Mode().IsRegular():
			fmt.Fprintf(&stamp, "%s:%d:%d;", f, fi.Size(), fi.ModTime().UnixNano())
		case i > 0 && errors.Is(err, fs.ErrNotExist):
			stamp.WriteString(f + ":absent;")
		case err == nil:
			return "", fmt.Errorf("%s/%s: not a regular file", slug, f)
		default:
			return "", err
		}
	}
	if c, ok := t.cache[slug]; ok && c.stamp == stamp.String() {
		return c.sum, nil
	}
	h := sha256.New()
	for _, f := range tokFiles {
		if err := hashFile(h, filepath.Join(t.dir, slug, f), f); err != nil {
			return "", err
		}
	}
	s := hex.EncodeToString(h.Sum(nil)[:8])
	t.cache[slug] = tokSum{stamp: stamp.String(), sum: s}
	return s, nil
}

// hashFile writes name, the length and the content of path (or a marker
// of its absence) into h, so moving bytes between files changes the sum.
func hashFile(h io.Writer, path, name string) error {
	f, err := os.Open(path)
	if errors.Is(err, fs.ErrNotExist) {
		_, err = io.WriteString(h, name+"\x00absent\x00")
		return err
	}
	if err != nil {
		return err
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return err
	}
	var n [8]byte
	binary.BigEndian.PutUint64(n[:], uint64(fi.Size()))
	io.WriteString(h, name+"\x00")
	h.Write(n[:])
	if _, err := io.Copy(h, f); err != nil {
		return err
	}
	return nil
}
