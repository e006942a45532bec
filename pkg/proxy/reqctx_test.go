package proxy

import (
	"context"
	"errors"
	"testing"
	"time"
)

type ctxKey struct{}

func TestReqCtxCancellation(t *testing.T) {
	vals := context.WithValue(context.Background(), ctxKey{}, "v")
	c := &reqCtx{vals: vals}
	if c.Value(ctxKey{}) != "v" || c.Err() != nil {
		t.Fatalf("fresh context: value %v, err %v", c.Value(ctxKey{}), c.Err())
	}
	derived, cancel := context.WithTimeout(c, time.Hour)
	defer cancel()
	fired := make(chan struct{})
	stop := context.AfterFunc(c, func() { close(fired) })
	upRan := 0
	if !c.watchUpstream(func() { upRan++ }) {
		t.Fatal("empty upstream slot refused")
	}
	if c.watchUpstream(func() {}) {
		t.Fatal("second upstream canceller took the occupied slot")
	}
	done := c.Done()

	c.cancel()
	c.cancel() // idempotent
	<-done
	<-derived.Done()
	<-fired
	if !errors.Is(c.Err(), context.Canceled) || !errors.Is(derived.Err(), context.Canceled) {
		t.Errorf("errors after cancel: %v, derived %v", c.Err(), derived.Err())
	}
	if upRan != 1 || c.unwatchUpstream() {
		t.Errorf("upstream canceller ran %d times, unwatch after it reported true", upRan)
	}
	if stop() {
		t.Error("AfterFunc stop reported true after it ran")
	}
	// Registered after the end: runs at once.
	if !c.watchUpstream(func() { upRan++ }) || upRan != 2 {
		t.Errorf("canceller registered after cancel ran %d times in all, want 2", upRan)
	}
	late := make(chan struct{})
	context.AfterFunc(c, func() { close(late) })
	<-late
}

func TestReqCtxStopBeforeCancel(t *testing.T) {
	c := &reqCtx{vals: context.Background()}
	ran := false
	c.watchUpstream(func() { ran = true })
	if !c.unwatchUpstream() {
		t.Error("unwatch before cancel reported false")
	}
	stop := context.AfterFunc(c, func() { t.Error("stopped AfterFunc ran") })
	if !stop() {
		t.Error("stop before cancel reported false")
	}
	c.cancel()
	if ran {
		t.Error("unwatched canceller ran")
	}
	if c.Done() == nil {
		t.Fatal("nil Done")
	}
	select {
	case <-c.Done():
	default:
		t.Error("Done asked for after cancel is open")
	}
}
