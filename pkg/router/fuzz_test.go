package router

import (
	"strings"
	"testing"
)

func FuzzParseReceipt(f *testing.F) {
	f.Add("tier=tier1.5 ep=2 matched=12/16 reason=longest_prefix")
	f.Add("tier=spill ep=0 matched=0/16 from=2 reason=over_cap")
	f.Add("tier=fallback ep=-1 matched=0/0 reason=no_healthy extra=1")
	f.Add("matched=/ ep== tier")
	f.Fuzz(func(t *testing.T, s string) {
		r, err := ParseReceipt(s)
		if err != nil {
			return
		}
		if strings.ContainsAny(r.Tier+r.Reason, " \t\n\r\v\f") {
			return // not producible by String; parsing split on it
		}
		again, err := ParseReceipt(r.String())
		if err != nil || again != r {
			t.Fatalf("round trip of %q: %+v -> %q -> %+v, %v", s, r, r.String(), again, err)
		}
	})
}
