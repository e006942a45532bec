package kvindex

import "unsafe"

// table is an open-addressing hash map from uint64 keys to small non-zero
// values, with linear probing and backward-shift deletion (no tombstones).
//
// A Go map[uint64]uint64 costs about 40 bytes per entry once bucket overhead
// and growth slack are counted; this table costs 16 bytes per slot (keys and
// values in separate arrays, so no padding) at a load factor of at most 0.8.
// Keys are engine block hashes, already uniformly distributed, but they are
// still multiplied by a Fibonacci constant so a structured key set cannot
// cluster. The value 0 marks an empty slot, so callers never store 0; every
// key, including 0, is a valid key.
type table[V uint8 | uint64] struct {
	keys  []uint64
	vals  []V
	n     int
	shift uint8 // 64 - log2(len(keys))
}

const (
	minTableSlots = 8
	fibMul        = 0x9E3779B97F4A7C15
)

func newTable[V uint8 | uint64](hint int) table[V] {
	var t table[V]
	t.alloc(slotsFor(hint))
	return t
}

// slotsFor is the smallest power of two holding n entries under the load
// limit.
func slotsFor(n int) int {
	s := minTableSlots
	for n*5 > s*4 {
		s <<= 1
	}
	return s
}

func (t *table[V]) alloc(slots int) {
	t.keys = make([]uint64, slots)
	t.vals = make([]V, slots)
	t.n = 0
	bits := uint8(0)
	for 1<<bits < slots {
		bits++
	}
	t.shift = 64 - bits
}

func (t *table[V]) home(k uint64) int { return int((k * fibMul) >> t.shift) }

// find returns the slot holding k, or -1.
func (t *table[V]) find(k uint64) int {
	if t.n == 0 {
		return -1
	}
	mask := len(t.keys) - 1
	for i := t.home(k); ; i = (i + 1) & mask {
		if t.vals[i] == 0 {
			return -1
		}
		if t.keys[i] == k {
			return i
		}
	}
}

// get returns the value of k, or 0 when absent.
func (t *table[V]) get(k uint64) V {
	if t.n == 0 {
		return 0
	}
	mask := len(t.keys) - 1
	for i := t.home(k); ; i = (i + 1) & mask {
		v := t.vals[i]
		if v == 0 || t.keys[i] == k {
			return v
		}
	}
}

// put sets k to v (v != 0), inserting it if absent.
func (t *table[V]) put(k uint64, v V) {
	if t.keys == nil {
		t.alloc(minTableSlots)
	}
	if (t.n+1)*5 > len(t.keys)*4 {
		t.resize(len(t.keys) * 2)
	}
	mask := len(t.keys) - 1
	for i := t.home(k); ; i = (i + 1) & mask {
		if t.vals[i] == 0 {
			t.keys[i], t.vals[i] = k, v
			t.n++
			return
		}
		if t.keys[i] == k {
			t.vals[i] = v
			return
		}
	}
}

// del removes k if present.
func (t *table[V]) del(k uint64) {
	if i := t.find(k); i >= 0 {
		t.delAt(i)
	}
}

// delAt empties slot i and shifts later members of its probe run back, so
// lookups never need tombstones.
func (t *table[V]) delAt(i int) {
	mask := len(t.keys) - 1
	j := i
	for {
		j = (j + 1) & mask
		if t.vals[j] == 0 {
			break
		}
		h := t.home(t.keys[j])
		// The entry at j may fill the hole at i only if i lies on its probe
		// path, i.e. i is no further from j than j's home is.
		if (j-h)&mask >= (j-i)&mask {
			t.keys[i], t.vals[i] = t.keys[j], t.vals[j]
			i = j
		}
	}
	t.keys[i], t.vals[i] = 0, 0
	t.n--
}

func (t *table[V]) resize(slots int) {
	oldK, oldV := t.keys, t.vals
	t.alloc(slots)
	mask := slots - 1
	for i, v := range oldV {
		if v == 0 {
			continue
		}
		k := oldK[i]
		j := t.home(k)
		for t.vals[j] != 0 {
			j = (j + 1) & mask
		}
		t.keys[j], t.vals[j] = k, v
		t.n++
	}
}

// update replaces every value with fn(key, value) and removes entries
// mapped to 0, in place. After a deletion the same slot is examined again,
// because backward shifting may have moved an unvisited entry into it; an
// entry may also be shifted from the already-visited start of the array
// into the unvisited tail and be seen twice, so fn must be idempotent
// (applying it to its own result changes nothing). fn must not touch t.
// It is O(slots) and meant for rare bulk operations (rank and endpoint
// clears); it does not allocate.
func (t *table[V]) update(fn func(k uint64, v V) V) {
	for i := 0; i < len(t.vals) && t.n > 0; {
		v := t.vals[i]
		if v == 0 {
			i++
			continue
		}
		nv := fn(t.keys[i], v)
		if nv == 0 {
			t.delAt(i)
			continue
		}
		t.vals[i] = nv
		i++
	}
	t.maybeShrink()
}

// maybeShrink gives memory back after mass deletion. The shrink threshold
// (1/16 full) is far below the growth threshold (4/5), so a table
// oscillating around one size never thrashes.
func (t *table[V]) maybeShrink() {
	if n := t.shrinkSlots(); n > 0 {
		t.resize(n)
	}
}

// shrinkSlots is the size maybeShrink would shrink t to, or 0.
func (t *table[V]) shrinkSlots() int {
	if len(t.keys) > 1024 && t.n*16 < len(t.keys) {
		return slotsFor(t.n)
	}
	return 0
}

// resized returns a copy of t with the given number of slots, leaving t
// as it is, so a writer can build it while queries still read t and swap
// it in under the lock. Its pages are faulted in here, not on first use.
func (t *table[V]) resized(slots int) *table[V] {
	nt := &table[V]{}
	nt.alloc(slots)
	prefault(nt.keys)
	prefault(nt.vals)
	for i, v := range t.vals {
		if v != 0 {
			nt.insertAbsent(t.keys[i], v)
		}
	}
	return nt
}

// prefault writes to every page of a freshly allocated slice. Memory new
// from the OS is mapped on first touch, at several microseconds a page on
// a virtual machine; writers call this before taking the query lock so
// that cost is not paid under it.
func prefault[E uint8 | uint64](s []E) {
	var zero E
	step := max(4096/int(unsafe.Sizeof(zero)), 1)
	for i := 0; i < len(s); i += step {
		s[i] = 0
	}
}

// each calls fn for every entry until fn returns false. fn must not modify t.
func (t *table[V]) each(fn func(k uint64, v V) bool) {
	if t.n == 0 {
		return
	}
	for i, v := range t.vals {
		if v != 0 && !fn(t.keys[i], v) {
			return
		}
	}
}

// insertAbsent stores k (absent, v != 0) and returns its slot. The caller
// guarantees room: it never resizes.
func (t *table[V]) insertAbsent(k uint64, v V) int {
	mask := len(t.keys) - 1
	i := t.home(k)
	for t.vals[i] != 0 {
		i = (i + 1) & mask
	}
	t.keys[i], t.vals[i] = k, v
	t.n++
	return i
}

// full reports whether one more entry would exceed the load limit.
func (t *table[V]) full() bool { return (t.n+1)*5 > len(t.keys)*4 }

// incrementalSlots is the table size from which a service table moves to a
// new size incrementally. Below it the new table (at most 32 KiB) comes
// from the allocator's small-object caches and a whole rehash of at most
// 820 entries takes microseconds, so it is done in place. Larger tables
// are not: a fresh 1 MiB table alone costs 256 page faults, over a
// millisecond on a virtual machine.
const incrementalSlots = 1 << 10

// gtable is a service's block table. Readers see it under the service's
// read lock, so it never rehashes everything at once once it is large:
// the writer allocates the table of the next size outside the lock
// (wantSlots, then install), and from then on the entries of the previous
// table (old) move over in bounded steps (migrate), a few slots per key
// written, while lookups check old only when the current table misses and
// a move is in progress. Every key lives in exactly one of the two: a
// writer touching a key still in old moves it first (find).
//
// Invariant while moving: old's slots below cursor are empty. Removing
// from old uses backward-shift deletion, which only moves entries towards
// their home and stops at the first empty slot, so no entry is ever shifted
// into the part already moved.
type gtable struct {
	table[uint64]
	old    table[uint64]
	cursor int
}

// get returns the endpoint mask of k, or 0 when absent.
func (t *gtable) get(k uint64) uint64 {
	if v := t.table.get(k); v != 0 || t.old.n == 0 {
		return v
	}
	return t.old.get(k)
}

// find returns the slot of k in the current table, moving k there first if
// it is still in old, or -1.
func (t *gtable) find(k uint64) int {
	if i := t.table.find(k); i >= 0 || t.old.n == 0 {
		return i
	}
	j := t.old.find(k)
	if j < 0 {
		return -1
	}
	v := t.old.vals[j]
	t.old.delAt(j)
	t.settled()
	t.roomFor1()
	return t.table.insertAbsent(k, v)
}

// put inserts k, which find just reported absent, with value v.
func (t *gtable) put(k uint64, v uint64) {
	if t.keys == nil {
		t.alloc(minTableSlots)
	}
	t.roomFor1()
	t.table.insertAbsent(k, v)
}

// roomFor1 makes room for one more entry in the current table. Normally
// there is room: a large table is replaced (install) before a write could
// take it past 4/5 load, and with two entries moved per key written the
// move is done when the new table is 3/5 full. If the writer could
// not install in time (or a shrink undershot), the move is finished and the
// table resized here, under the lock, as a small table always is.
func (t *gtable) roomFor1() {
	if !t.full() {
		return
	}
	if t.old.n > 0 {
		t.migrate(len(t.old.keys), len(t.old.keys))
	}
	if t.full() {
		t.resize(2 * len(t.keys))
	}
}

// wantSlots returns the size a large table should move to before nkeys
// more keys are written, or 0: double when they could take it past the
// load limit (so it grows at the same load, and costs the same memory, as
// a small table), shrink below 1/16 load. The caller allocates it without
// holding the readers' lock and hands it to install. Writers are
// serialised, so no other write lands between the check and the install.
func (t *gtable) wantSlots(nkeys int) int {
	s := len(t.keys)
	switch {
	case t.old.n > 0 || s < incrementalSlots:
		return 0
	case (t.n+nkeys)*5 > s*4:
		// Doubling suffices unless one chunk outgrows a small table.
		return max(2*s, slotsFor(t.n+nkeys))
	case t.n > 0 && t.n*16 < s:
		return slotsFor(2 * t.n)
	}
	return 0
}

// install makes keys/vals (zeroed, len a power of two, allocated by the
// caller outside the lock) the current table and starts moving the
// previous one over. It must follow wantSlots with no write in between.
func (t *gtable) install(keys []uint64, vals []uint64) {
	prev := t.table
	t.table = table[uint64]{keys: keys, vals: vals}
	bits := uint8(0)
	for 1<<bits < len(keys) {
		bits++
	}
	t.shift = 64 - bits
	t.old, t.cursor = prev, 0
}

// migrate moves up to moves entries from old, scanning at most scan slots,
// and releases old once it is empty.
func (t *gtable) migrate(moves, scan int) {
	for t.old.n > 0 && moves > 0 && scan > 0 {
		i := t.cursor
		v := t.old.vals[i]
		if v == 0 {
			t.cursor++
			scan--
			continue
		}
		k := t.old.keys[i]
		if t.table.full() {
			// Only a shrink that undershot gets here.
			t.table.resize(2 * len(t.keys))
		}
		// delAt may shift a later entry into slot i; the loop looks at i
		// again.
		t.old.delAt(i)
		t.table.insertAbsent(k, v)
		moves--
	}
	t.settled()
}

func (t *gtable) settled() {
	if t.old.n == 0 && t.old.keys != nil {
		t.old, t.cursor = table[uint64]{}, 0
	}
}

// moving reports whether entries are still in old.
func (t *gtable) moving() bool { return t.old.n > 0 }

// maybeShrink gives memory back after mass deletion: an empty table is
// dropped, a small one resized in place; a large one with entries left
// shrinks through wantSlots and install instead.
func (t *gtable) maybeShrink() {
	switch {
	case t.old.n > 0:
	case t.n == 0 && len(t.keys) > 1024:
		t.table = table[uint64]{}
	case len(t.keys) < incrementalSlots:
		t.table.maybeShrink()
	}
}

// len is the number of keys in both tables.
func (t *gtable) len() int { return t.n + t.old.n }

// each calls fn for every entry of both tables until fn returns false. fn
// must not modify t.
func (t *gtable) each(fn func(k uint64, v uint64) bool) {
	stopped := false
	t.table.each(func(k, v uint64) bool {
		stopped = !fn(k, v)
		return !stopped
	})
	if !stopped {
		t.old.each(fn)
	}
}
