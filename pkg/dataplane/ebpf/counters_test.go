package ebpf

import (
	"maps"
	"testing"
)

// A cached redirect is counted once by the program, under its direction's
// fib_cached counter; Stats must report it as a hit of that direction, a
// redirect and a cached redirect, and never show the internal reply counter.
func TestFoldCachedHits(t *testing.T) {
	got := map[string]uint64{
		"ct_hit_orig": 2, "ct_hit_reply": 3, "fwd_redirect": 4, "fwd_stack": 1,
		"fib_cached": 10, "fib_cached_reply": 20,
	}
	foldCachedHits(got)
	want := map[string]uint64{
		"ct_hit_orig": 12, "ct_hit_reply": 23, "fwd_redirect": 34, "fwd_stack": 1, "fib_cached": 30,
	}
	if !maps.Equal(got, want) {
		t.Fatalf("folded counters %v, want %v", got, want)
	}
}
