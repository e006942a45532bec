package proxy

import "time"

// Coarse deadlines. A socket deadline change is a timer update in the
// runtime: the poller's lock, then a sift through the P's timer heap,
// whose size grows with the connections held open. Setting a deadline
// before every keep-alive wait and every endpoint answer, and clearing it
// after, cost two such updates per request on each side; at 256
// connections the timer heap work per request tripled against 64, its
// entries no longer in cache.
//
// A coarse deadline is instead set a little later than asked, at now plus
// d plus d/16, and left alone while it still falls within [now+d,
// now+d+d/16]: a connection that carries a request every few milliseconds
// moves it once per d/16 (7.5 s for the 120 s client idle timeout)
// instead of twice per request. The bound holds, only late by at most a
// sixteenth: no wait is cut before d.

// coarseSlack is how much later than asked a coarse deadline may fire.
func coarseSlack(d time.Duration) time.Duration { return d / 16 }

// coarseDeadline returns the deadline a wait of d starting now should
// have, given cur, the one in force (zero: none), and whether cur must be
// replaced by it.
func coarseDeadline(cur, now time.Time, d time.Duration) (time.Time, bool) {
	lo := now.Add(d)
	if !cur.IsZero() && !cur.Before(lo) && !cur.After(lo.Add(coarseSlack(d))) {
		return cur, false
	}
	return lo.Add(coarseSlack(d)), true
}
