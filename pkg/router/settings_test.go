package router

import "testing"

// TestSettingsCompareEffectiveValues: nodes compare what they run, so an
// unset variable and its default spelled out are the same setting, and a
// different value is not.
func TestSettingsCompareEffectiveValues(t *testing.T) {
	env := func(m map[string]string) func(string) string { return func(k string) string { return m[k] } }
	unset, err := ConfigFromEnv(env(nil))
	if err != nil {
		t.Fatal(err)
	}
	spelled, err := ConfigFromEnv(env(map[string]string{EnvMinMatchTokens: "16", EnvLoadPenalty: "ADAPTIVE", EnvTierWeightCPU: "0.80"}))
	if err != nil {
		t.Fatal(err)
	}
	other, err := ConfigFromEnv(env(map[string]string{EnvSpillRelief: "off", EnvMinMatchTokens: "32"}))
	if err != nil {
		t.Fatal(err)
	}
	a, b, c := unset.Settings(), spelled.Settings(), other.Settings()
	if len(a) != 9 {
		t.Fatalf("%d settings: %v", len(a), a)
	}
	for k, v := range a {
		if b[k] != v {
			t.Errorf("%s: unset %q, default spelled out %q", k, v, b[k])
		}
	}
	if c[EnvSpillRelief] != "false" || a[EnvSpillRelief] != "auto" || c[EnvMinMatchTokens] != "32" {
		t.Errorf("changed settings not shown: %v", c)
	}
}
