package gateway

import (
	"sync"
	"time"
)

// logEvery is how often a condition a client can repeat at will (an
// unknown model, an oversized request) is logged; the lines in between
// are counted and reported with the next one.
const logEvery = 10 * time.Second

// logLimiter lets one log line through per interval.
type logLimiter struct {
	every time.Duration

	mu         sync.Mutex
	next       time.Time
	suppressed int
}

// allow reports whether to log now and how many lines were held back
// since the last one.
func (l *logLimiter) allow(now time.Time) (ok bool, suppressed int) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if now.Before(l.next) {
		l.suppressed++
		return false, 0
	}
	l.next = now.Add(l.every)
	suppressed, l.suppressed = l.suppressed, 0
	return true, suppressed
}
