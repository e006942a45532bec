package bench

import (
	"fmt"
	"io"
	"strings"
	"sync"
	"time"
)

// progress draws a one-line bar on a terminal-like writer, at most ten
// times a second.
type progress struct {
	mu    sync.Mutex
	w     io.Writer
	total int
	done  int
	what  string
	start time.Time
	last  time.Time
}

func newProgress(w io.Writer, total int) *progress {
	return &progress{w: w, total: total, start: time.Now()}
}

func (p *progress) label(s string) {
	if p == nil || p.w == nil {
		return
	}
	p.mu.Lock()
	p.what = s
	p.drawLocked(true)
	p.mu.Unlock()
}

func (p *progress) add(n int) {
	if p == nil || p.w == nil {
		return
	}
	p.mu.Lock()
	p.done += n
	p.drawLocked(false)
	p.mu.Unlock()
}

func (p *progress) drawLocked(force bool) {
	now := time.Now()
	if !force && now.Sub(p.last) < 100*time.Millisecond && p.done < p.total {
		return
	}
	p.last = now
	const width = 30
	frac := 0.0
	if p.total > 0 {
		frac = float64(p.done) / float64(p.total)
	}
	fill := int(frac * width)
	fmt.Fprintf(p.w, "\r[%s%s] %3.0f%% %d/%d requests  %-28s %6s", strings.Repeat("#", fill), strings.Repeat(".", width-fill),
		100*frac, p.done, p.total, p.what, now.Sub(p.start).Round(time.Second))
}

func (p *progress) finish() {
	if p == nil || p.w == nil {
		return
	}
	p.mu.Lock()
	p.drawLocked(true)
	fmt.Fprintln(p.w)
	p.mu.Unlock()
}
