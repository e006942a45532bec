package gateway

import "testing"

func TestPrefillWorkCounts(t *testing.T) {
	var pw prefillWork
	a := pw.add(1, 0, 1000)
	b := pw.add(1, 0, 24)
	c := pw.add(1, 2, 500)
	none := pw.add(1, 3, 0)
	if got := pw.outstanding(1, 0); got != 1024 {
		t.Fatalf("ep 0: %d, want 1024", got)
	}
	a()
	a() // a second release is harmless
	none()
	if got := pw.outstanding(1, 0); got != 24 {
		t.Fatalf("ep 0 after one release: %d, want 24", got)
	}
	if got := pw.outstanding(2, 0); got != 0 {
		t.Fatalf("another service sees %d", got)
	}
	// A removed rule's late releases do not touch a new rule's counts.
	pw.forget(1)
	d := pw.add(1, 2, 300)
	c()
	if got := pw.outstanding(1, 2); got != 300 {
		t.Fatalf("ep 2 after forget: %d, want 300", got)
	}
	b()
	d()
	if len(pw.m) != 0 {
		t.Fatalf("counts left behind: %v", pw.m)
	}
}
