package store

import (
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// pristineStore builds a store with enough records for branch pages and an
// overflow page, closes it and returns its bytes and page size.
func pristineStore(t testing.TB) ([]byte, int) {
	t.Helper()
	dir := t.TempDir()
	s, err := OpenBolt(dir)
	if err != nil {
		t.Fatal(err)
	}
	for i := 0; i < 120; i++ {
		id, err := s.NextID()
		if err != nil {
			t.Fatal(err)
		}
		body := fmt.Sprintf(`{"serviceArguments":{"externalIP":"127.0.0.%d","port":%d},"pad":%q}`, i%250+1, 8000+i, strings.Repeat("x", 200))
		if i == 7 {
			body = fmt.Sprintf(`{"big":%q}`, strings.Repeat("y", 3*os.Getpagesize()))
		}
		if err := s.Put(Record{ID: id, Rule: json.RawMessage(body), CreateBody: json.RawMessage(body)}); err != nil {
			t.Fatal(err)
		}
		if i%5 == 0 && i > 0 {
			if err := s.Delete(id - 1); err != nil {
				t.Fatal(err)
			}
		}
	}
	s.Close()
	b, err := os.ReadFile(filepath.Join(dir, "rules.db"))
	if err != nil {
		t.Fatal(err)
	}
	return b, int(binary.NativeEndian.Uint32(b[pageHeaderSize+8:]))
}

func openBytes(t testing.TB, b []byte) (*Bolt, string, error) {
	t.Helper()
	dir := t.TempDir()
	path := filepath.Join(dir, "rules.db")
	if err := os.WriteFile(path, b, 0o600); err != nil {
		t.Fatal(err)
	}
	s, err := OpenBolt(dir)
	return s, path, err
}

type corruption struct {
	name string
	edit func(b []byte, ps int) []byte
}

func fill(b []byte, off, n int, v byte) {
	for i := off; i < off+n && i < len(b); i++ {
		b[i] = v
	}
}

// rootPage is the root bucket page named by the newest meta.
func rootPage(b []byte, ps int) int {
	m0, m1 := b[pageHeaderSize:], b[ps+pageHeaderSize:]
	m := m0
	if binary.NativeEndian.Uint64(m1[48:]) > binary.NativeEndian.Uint64(m0[48:]) {
		m = m1
	}
	return int(binary.NativeEndian.Uint64(m[16:]))
}

// highWater is the number of pages in use by the newest meta; the file may
// be longer.
func highWater(b []byte, ps int) int {
	m0, m1 := b[pageHeaderSize:], b[ps+pageHeaderSize:]
	return int(max(binary.NativeEndian.Uint64(m0[40:]), binary.NativeEndian.Uint64(m1[40:])))
}

// corruptions are the damage a store file meets: a crash mid-copy, a disk
// returning zeroes, a stray write, a file that is not a store at all.
var corruptions = []corruption{
	{"empty", func(b []byte, ps int) []byte { return nil }},
	{"one byte", func(b []byte, ps int) []byte { return b[:1] }},
	{"truncated inside meta 0", func(b []byte, ps int) []byte { return b[:40] }},
	{"truncated to one page", func(b []byte, ps int) []byte { return b[:ps] }},
	{"truncated to two pages", func(b []byte, ps int) []byte { return b[:2*ps] }},
	{"truncated by half", func(b []byte, ps int) []byte { return b[:len(b)/2] }},
	{"last used page cut off", func(b []byte, ps int) []byte { return b[:(highWater(b, ps)-1)*ps] }},
	{"truncated mid page", func(b []byte, ps int) []byte { return b[:highWater(b, ps)*ps-ps/2] }},
	{"meta 0 zeroed", func(b []byte, ps int) []byte { fill(b, 0, ps, 0); return b }},
	{"meta 1 zeroed", func(b []byte, ps int) []byte { fill(b, ps, ps, 0); return b }},
	{"both metas zeroed", func(b []byte, ps int) []byte { fill(b, 0, 2*ps, 0); return b }},
	{"wrong magic", func(b []byte, ps int) []byte {
		copy(b[pageHeaderSize:], "XXXX")
		copy(b[ps+pageHeaderSize:], "XXXX")
		return b
	}},
	{"random bytes in meta 0", func(b []byte, ps int) []byte {
		r := rand.New(rand.NewPCG(1, 2))
		for i := pageHeaderSize; i < pageHeaderSize+metaSize; i++ {
			b[i] = byte(r.Uint32())
		}
		return b
	}},
	{"random bytes in meta 1", func(b []byte, ps int) []byte {
		r := rand.New(rand.NewPCG(3, 4))
		for i := ps + 8; i < ps+pageHeaderSize+metaSize; i++ {
			b[i] = byte(r.Uint32())
		}
		return b
	}},
	{"root page zeroed", func(b []byte, ps int) []byte { fill(b, rootPage(b, ps)*ps, ps, 0); return b }},
	{"root page 0xff", func(b []byte, ps int) []byte { fill(b, rootPage(b, ps)*ps, ps, 0xff); return b }},
	{"every data page zeroed", func(b []byte, ps int) []byte { fill(b, 2*ps, len(b), 0); return b }},
	{"data page ids shifted", func(b []byte, ps int) []byte {
		for p := 2; (p+1)*ps <= len(b); p++ {
			b[p*ps]++
		}
		return b
	}},
	{"not a store", func(b []byte, ps int) []byte { return []byte("this is not a bolt file, just garbage bytes........") }},
	{"random file", func(b []byte, ps int) []byte {
		r := rand.New(rand.NewPCG(5, 6))
		for i := range b {
			b[i] = byte(r.Uint32())
		}
		return b
	}},
}

// TestBoltCorruptVariants: every kind of damage is a *CorruptError naming
// the file and the way out; none panics, none opens as an empty store.
func TestBoltCorruptVariants(t *testing.T) {
	pristine, ps := pristineStore(t)
	if s, _, err := openBytes(t, pristine); err != nil {
		t.Fatalf("pristine store does not open: %v", err)
	} else {
		s.Close()
	}
	for _, c := range corruptions {
		t.Run(c.name, func(t *testing.T) {
			b := c.edit(append([]byte(nil), pristine...), ps)
			s, path, err := openBytes(t, b)
			if err == nil {
				s.Close()
				t.Fatal("corrupt store opened")
			}
			var ce *CorruptError
			if !errors.As(err, &ce) || !errors.Is(err, ErrCorrupt) {
				t.Fatalf("want *CorruptError, got %T: %v", err, err)
			}
			msg := err.Error()
			if !strings.Contains(msg, path) || !strings.Contains(msg, "move it aside") {
				t.Fatalf("message does not name the file and the way out: %s", msg)
			}
			if st, err := os.Stat(path); err != nil || st.Size() != int64(len(b)) {
				t.Fatalf("the corrupt file was changed: %v", err)
			}
		})
	}
}

// TestBoltBitFlips flips random bits all over a valid store: each result
// either opens (the flip hit unused bytes or a value) or is a
// *CorruptError; nothing panics, loops or faults.
func TestBoltBitFlips(t *testing.T) {
	pristine, ps := pristineStore(t)
	r := rand.New(rand.NewPCG(7, 8))
	var corrupt, opened int
	for i := 0; i < flipRounds; i++ {
		b := append([]byte(nil), pristine...)
		for n := 1 + r.IntN(4); n > 0; n-- {
			// Bias to page headers and element tables, where flips hurt.
			page := r.IntN(len(b) / ps)
			off := page*ps + r.IntN(min(ps, 128))
			if r.IntN(3) == 0 {
				off = r.IntN(len(b))
			}
			b[off] ^= 1 << r.IntN(8)
		}
		s, _, err := openBytes(t, b)
		if err == nil {
			opened++
			if _, err := s.List(); err != nil {
				t.Fatalf("flip %d: opened but List fails: %v", i, err)
			}
			s.Close()
			continue
		}
		if !errors.Is(err, ErrCorrupt) {
			t.Fatalf("flip %d: want ErrCorrupt, got %v", i, err)
		}
		corrupt++
	}
	t.Logf("%d corrupt, %d opened", corrupt, opened)
}

// TestBoltHealthyAfterChurn: a store after many writes, deletes and
// reopens passes verification every time (no false alarms).
func TestBoltHealthyAfterChurn(t *testing.T) {
	dir := t.TempDir()
	for round := 0; round < 5; round++ {
		s, err := OpenBolt(dir)
		if err != nil {
			t.Fatalf("round %d: %v", round, err)
		}
		for i := 0; i < 50; i++ {
			id, _ := s.NextID()
			v := json.RawMessage(fmt.Sprintf(`{"r":%d,"p":%q}`, round, strings.Repeat("z", (i*97)%5000)))
			if err := s.Put(Record{ID: id, Rule: v, CreateBody: v}); err != nil {
				t.Fatal(err)
			}
			if i%3 == 0 {
				_ = s.Delete(id)
			}
		}
		s.Close()
	}
}

// flipRounds is how many damaged copies TestBoltBitFlips opens.
const flipRounds = 300
