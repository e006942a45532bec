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

func FuzzConfigFromEnv(f *testing.F) {
	f.Add("16", "on", "16", "16", "50", "175", "32")
	f.Add("-1", "maybe", "x", "", "0", "99999999999999999999", " 7 ")
	f.Fuzz(func(t *testing.T, mm, spill, seed, minb, zero, mlf, pen string) {
		env := map[string]string{
			EnvMinMatchTokens: mm, EnvSpillRelief: spill, EnvColdSeedN: seed, EnvColdMinBlocks: minb,
			EnvZeroHitN: zero, EnvMeanLoadFactor: mlf, EnvLoadPenalty: pen,
		}
		c, err := ConfigFromEnv(func(k string) string { return env[k] })
		if err != nil {
			return
		}
		if err := c.Validate(); err != nil {
			t.Fatalf("ConfigFromEnv returned an invalid config %+v: %v", c, err)
		}
	})
}
