package selector

import (
	"errors"
	"fmt"
)

// ErrMaglevSize is returned for a table size that is not a prime >= 2 or
// that is smaller than the number of backends.
var ErrMaglevSize = errors.New("maglev table size must be a prime no smaller than the backend count")

// BuildMaglev fills a Maglev consistent-hash lookup table (Eisenbud et al.,
// NSDI 2016) of the given prime size for the L4 data path: entry k holds the
// backend (index into weights) that owns hash bucket k. Backends with weight
// <= 0 get no entries. Weighted backends take turns in proportion to their
// weight, so their share of entries is proportional to weight; removing a
// backend moves little more than the entries it owned.
func BuildMaglev(weights []int, size int) ([]int, error) {
	if size < 2 || !isPrime(size) || size < len(weights) {
		return nil, fmt.Errorf("%w: size %d for %d backends", ErrMaglevSize, size, len(weights))
	}
	maxW := 0
	for _, w := range weights {
		maxW = max(maxW, w)
	}
	if maxW <= 0 {
		return nil, errors.New("maglev: no backend has a positive weight")
	}
	m := uint64(size)
	offset := make([]uint64, len(weights))
	skip := make([]uint64, len(weights))
	next := make([]uint64, len(weights))
	for i := range weights {
		h1 := mix64(uint64(i) + 0x6a09e667f3bcc908)
		h2 := mix64(uint64(i) + 0xbb67ae8584caa73b)
		offset[i] = h1 % m
		skip[i] = h2%(m-1) + 1
	}
	table := make([]int, size)
	for k := range table {
		table[k] = -1
	}
	filled := 0
	for round := 0; filled < size; round++ {
		for i, w := range weights {
			if w <= 0 {
				continue
			}
			// A backend of weight w takes a turn in round r when
			// floor((r+1)w/maxW) > floor(r w/maxW): w turns per maxW rounds.
			if (round+1)*w/maxW == round*w/maxW {
				continue
			}
			for {
				c := (offset[i] + next[i]*skip[i]) % m
				next[i]++
				if table[c] < 0 {
					table[c] = i
					filled++
					break
				}
			}
			if filled == size {
				break
			}
		}
	}
	return table, nil
}

func isPrime(n int) bool {
	if n < 2 {
		return false
	}
	for d := 2; d*d <= n; d++ {
		if n%d == 0 {
			return false
		}
	}
	return true
}
