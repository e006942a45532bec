package kvindex

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
	if len(t.keys) > 1024 && t.n*16 < len(t.keys) {
		t.resize(slotsFor(t.n))
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
