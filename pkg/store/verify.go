package store

import (
	"encoding/binary"
	"errors"
	"fmt"
	"hash/fnv"
	"io"
)

// The on-disk layout of a bbolt file (format version 2), as bbolt writes it
// in internal/common. bbolt reads its pages through unsafe pointers into an
// mmap and trusts every offset it finds: a damaged file ends in an assertion
// panic, an unbounded loop or a fault on an address past the end of the
// file, none of which a recover() in the caller can always turn into an
// error (some happen in goroutines bbolt starts, a fault is not a panic at
// all). So the daemon walks the file itself, with bounds-checked reads,
// before bbolt ever maps it.
const (
	boltMagic         = 0xED0CDAED
	boltVersion       = 2
	pageHeaderSize    = 16 // id u64, flags u16, count u16, overflow u32
	elementSize       = 16 // branch: pos u32, ksize u32, pgid u64; leaf: flags u32, pos u32, ksize u32, vsize u32
	bucketHeaderSize  = 16 // root pgid u64, sequence u64
	metaSize          = 64 // magic, version, pageSize, flags, root, seq, freelist, pgid, txid, checksum
	metaChecksumStart = 56 // the checksum covers the meta bytes before it

	flagBranch   = 0x01
	flagLeaf     = 0x02
	flagMeta     = 0x04
	flagFreelist = 0x10
	leafIsBucket = 0x01

	noFreelist = ^uint64(0)

	minPageSize = 512
	maxPageSize = 1 << 20
)

var ne = binary.NativeEndian // bbolt writes pages in the host's byte order

// corruptf records why the file cannot be trusted.
func corruptf(format string, args ...any) error {
	return &verifyError{reason: fmt.Sprintf(format, args...)}
}

type verifyError struct{ reason string }

func (e *verifyError) Error() string { return e.reason }

type boltMeta struct {
	pageSize uint32
	root     uint64
	freelist uint64
	hwm      uint64 // pgid: the high-water mark, the first page never allocated
	txid     uint64
}

// verifyBoltFile checks the structure of the bbolt file at path: both meta
// pages, the freelist, and every page reachable from the root bucket of the
// newest meta (each visited once, every offset inside its page, every page
// inside the file). It reads through ReadAt, so a damaged file costs at most
// one read of each page and a bitmap of the page count, never a fault.
// A nil error means bbolt can open and walk the file without tripping.
func verifyBoltFile(f io.ReaderAt, size int64) error {
	if size == 0 {
		return corruptf("the file is empty (0 bytes): an initialized store is never empty")
	}
	var hdr [pageHeaderSize + metaSize]byte
	if n, err := f.ReadAt(hdr[:], 0); n < len(hdr) {
		return corruptf("the file is %d bytes, too short for a bbolt meta page (%v)", size, err)
	}
	m0, err := parseMeta(hdr[:], 0)
	if err != nil {
		return err
	}
	if int64(m0.pageSize)*2 > size {
		return corruptf("the file is %d bytes, shorter than its two meta pages of %d bytes", size, m0.pageSize)
	}
	if n, err := f.ReadAt(hdr[:], int64(m0.pageSize)); n < len(hdr) {
		return corruptf("cannot read meta page 1: %v", err)
	}
	m1, err := parseMeta(hdr[:], 1)
	if err != nil {
		return err
	}
	if m1.pageSize != m0.pageSize {
		return corruptf("meta pages disagree on the page size (%d and %d)", m0.pageSize, m1.pageSize)
	}
	for i, m := range []boltMeta{m0, m1} {
		if err := m.check(i, size); err != nil {
			return err
		}
	}
	// bbolt uses the meta with the higher transaction id.
	m := m0
	if m1.txid > m0.txid {
		m = m1
	}
	w := &walker{f: f, ps: int64(m.pageSize), hwm: m.hwm, seen: make([]uint64, (m.hwm+63)/64)}
	w.mark(0, 0)
	w.mark(1, 0)
	freed, err := w.freelist(m.freelist)
	if err != nil {
		return err
	}
	if err := w.tree(m.root); err != nil {
		return err
	}
	if m.freelist == noFreelist {
		return nil
	}
	for id := uint64(2); id < m.hwm; id++ {
		reached, free := w.seen[id/64]&(1<<(id%64)) != 0, freed[id]
		switch {
		case reached && free:
			return corruptf("page %d is both in use and on the freelist", id)
		case !reached && !free:
			return corruptf("page %d is neither in use nor on the freelist", id)
		}
	}
	return nil
}

func parseMeta(b []byte, idx int) (boltMeta, error) {
	id, flags := ne.Uint64(b[0:]), ne.Uint16(b[8:])
	mb := b[pageHeaderSize:]
	if magic := ne.Uint32(mb[0:]); magic != boltMagic {
		return boltMeta{}, corruptf("meta page %d: wrong magic %#x (not a bbolt file, or its header is overwritten)", idx, magic)
	}
	if v := ne.Uint32(mb[4:]); v != boltVersion {
		return boltMeta{}, corruptf("meta page %d: format version %d, want %d", idx, v, boltVersion)
	}
	h := fnv.New64a()
	_, _ = h.Write(mb[:metaChecksumStart])
	if sum := ne.Uint64(mb[metaChecksumStart:]); sum != h.Sum64() {
		return boltMeta{}, corruptf("meta page %d: checksum mismatch", idx)
	}
	if flags != flagMeta || id != uint64(idx) {
		return boltMeta{}, corruptf("meta page %d: page header says id %d flags %#x", idx, id, flags)
	}
	return boltMeta{pageSize: ne.Uint32(mb[8:]), root: ne.Uint64(mb[16:]), freelist: ne.Uint64(mb[32:]),
		hwm: ne.Uint64(mb[40:]), txid: ne.Uint64(mb[48:])}, nil
}

func (m boltMeta) check(idx int, size int64) error {
	ps := m.pageSize
	if ps < minPageSize || ps > maxPageSize || ps&(ps-1) != 0 {
		return corruptf("meta page %d: page size %d is not a power of two in %d..%d", idx, ps, minPageSize, maxPageSize)
	}
	if m.hwm < 3 || m.hwm > uint64(size)/uint64(ps) {
		return corruptf("meta page %d: %d pages in use, but the file holds %d (truncated?)", idx, m.hwm, size/int64(ps))
	}
	if m.root < 2 || m.root >= m.hwm {
		return corruptf("meta page %d: root page %d outside 2..%d", idx, m.root, m.hwm-1)
	}
	if m.freelist != noFreelist && (m.freelist < 2 || m.freelist >= m.hwm) {
		return corruptf("meta page %d: freelist page %d outside 2..%d", idx, m.freelist, m.hwm-1)
	}
	return nil
}

type walker struct {
	f    io.ReaderAt
	ps   int64
	hwm  uint64
	seen []uint64 // bitmap of pages accounted for (reachable, metas, freelist)
}

// mark claims page id and its overflow pages; a page claimed twice is a
// cycle or a shared page, both corrupt.
func (w *walker) mark(id uint64, overflow uint32) error {
	if id >= w.hwm || uint64(overflow) >= w.hwm-id {
		return corruptf("page %d (+%d overflow) runs past the high-water mark %d", id, overflow, w.hwm)
	}
	for p := id; p <= id+uint64(overflow); p++ {
		if w.seen[p/64]&(1<<(p%64)) != 0 {
			return corruptf("page %d is referenced twice", p)
		}
		w.seen[p/64] |= 1 << (p % 64)
	}
	return nil
}

// page reads page id with its overflow pages, checking its header.
func (w *walker) page(id uint64, want uint16) ([]byte, error) {
	var hdr [pageHeaderSize]byte
	if _, err := w.f.ReadAt(hdr[:], int64(id)*w.ps); err != nil {
		return nil, corruptf("page %d: %v", id, err)
	}
	gotID, flags, overflow := ne.Uint64(hdr[0:]), ne.Uint16(hdr[8:]), ne.Uint32(hdr[12:])
	if gotID != id {
		return nil, corruptf("page %d: header carries id %d", id, gotID)
	}
	if flags&want == 0 || flags&(flags-1) != 0 {
		return nil, corruptf("page %d: flags %#x, want a %s page", id, flags, pageKind(want))
	}
	if err := w.mark(id, overflow); err != nil {
		return nil, err
	}
	b := make([]byte, (int64(overflow)+1)*w.ps)
	if _, err := w.f.ReadAt(b, int64(id)*w.ps); err != nil {
		return nil, corruptf("page %d: %v", id, err)
	}
	return b, nil
}

func pageKind(flags uint16) string {
	switch flags {
	case flagFreelist:
		return "freelist"
	case flagMeta:
		return "meta"
	}
	return "branch or leaf"
}

func (w *walker) freelist(id uint64) (map[uint64]bool, error) {
	freed := map[uint64]bool{}
	if id == noFreelist {
		return freed, nil
	}
	b, err := w.page(id, flagFreelist)
	if err != nil {
		return nil, err
	}
	start, count := uint64(pageHeaderSize), uint64(ne.Uint16(b[10:]))
	if count == 0xFFFF {
		count, start = ne.Uint64(b[pageHeaderSize:]), pageHeaderSize+8
	}
	if count > (uint64(len(b))-start)/8 {
		return nil, corruptf("freelist page %d: %d ids do not fit in %d bytes", id, count, len(b))
	}
	for i := uint64(0); i < count; i++ {
		p := ne.Uint64(b[start+8*i:])
		if p < 2 || p >= w.hwm {
			return nil, corruptf("freelist page %d: free page %d outside 2..%d", id, p, w.hwm-1)
		}
		if freed[p] {
			return nil, corruptf("freelist page %d: page %d freed twice", id, p)
		}
		freed[p] = true
	}
	return freed, nil
}

// tree walks every page and inline bucket reachable from root without
// recursion, so a deep or cyclic damaged tree costs bounded stack.
func (w *walker) tree(root uint64) error {
	type item struct {
		id     uint64
		inline []byte // an inline bucket's page, when id is 0
	}
	stack := []item{{id: root}}
	for len(stack) > 0 {
		it := stack[len(stack)-1]
		stack = stack[:len(stack)-1]
		b, where := it.inline, "inline bucket page"
		if b == nil {
			var err error
			if b, err = w.page(it.id, flagBranch|flagLeaf); err != nil {
				return err
			}
			where = fmt.Sprintf("page %d", it.id)
		}
		flags, count := ne.Uint16(b[8:]), int(ne.Uint16(b[10:]))
		if pageHeaderSize+count*elementSize > len(b) {
			return corruptf("%s: %d elements do not fit in %d bytes", where, count, len(b))
		}
		switch flags {
		case flagBranch:
			if count == 0 {
				return corruptf("%s: empty branch page", where)
			}
			for i := 0; i < count; i++ {
				e := pageHeaderSize + i*elementSize
				pos, ksize, child := uint64(ne.Uint32(b[e:])), uint64(ne.Uint32(b[e+4:])), ne.Uint64(b[e+8:])
				if uint64(e)+pos+ksize > uint64(len(b)) {
					return corruptf("%s: branch element %d key runs past the page", where, i)
				}
				stack = append(stack, item{id: child})
			}
		case flagLeaf:
			for i := 0; i < count; i++ {
				e := pageHeaderSize + i*elementSize
				eflags, pos := ne.Uint32(b[e:]), uint64(ne.Uint32(b[e+4:]))
				ksize, vsize := uint64(ne.Uint32(b[e+8:])), uint64(ne.Uint32(b[e+12:]))
				end := uint64(e) + pos + ksize + vsize
				if end > uint64(len(b)) {
					return corruptf("%s: leaf element %d runs past the page", where, i)
				}
				if eflags&leafIsBucket == 0 {
					continue
				}
				v := b[end-vsize : end]
				if len(v) < bucketHeaderSize {
					return corruptf("%s: bucket element %d holds %d bytes, less than a bucket header", where, i, len(v))
				}
				if sub := ne.Uint64(v); sub != 0 {
					stack = append(stack, item{id: sub})
					continue
				}
				in := v[bucketHeaderSize:]
				if len(in) < pageHeaderSize || ne.Uint16(in[8:]) != flagLeaf {
					return corruptf("%s: bucket element %d has a malformed inline page", where, i)
				}
				stack = append(stack, item{inline: in})
			}
		default:
			return corruptf("%s: flags %#x, want a branch or leaf page", where, flags)
		}
	}
	return nil
}

// asVerifyError reports the reason of a verification failure.
func asVerifyError(err error) (string, bool) {
	var ve *verifyError
	if errors.As(err, &ve) {
		return ve.reason, true
	}
	return "", false
}
