package gateway

import "sync"

// prefillWork tracks, per (service, endpoint), the prefill work the gateway
// has sent and not yet seen answered: the uncached prompt tokens of every
// request routed there (on a named data-parallel rank, what that rank
// lacks, not what the endpoint's deepest rank lacks: the rank computes
// them), from the routing decision until its first byte
// (or its end, when it fails before one). Requests held for a shared
// prefill or queued for a prefill slot count from the decision: they are
// committed to the endpoint. The router places misses by it
// (selector.Candidate.PrefillTokens): it sees, at the instant of the
// decision, the long prefills that cached prefixes concentrate on a few
// endpoints, which the engines' scraped gauges report only seconds later
// and the in-flight count cannot tell from short cached requests.
type prefillWork struct {
	mu sync.Mutex
	m  map[heldKey]*workCount
}

// workCount is one endpoint's count. A release subtracts from the count it
// added to, so the releases of a removed rule's requests cannot touch the
// counts of a later rule with the same number.
type workCount struct{ tokens int64 }

// add counts tokens of prefill work on ep and returns the function that
// uncounts them; calling it more than once is harmless.
func (pw *prefillWork) add(service uint32, ep int, tokens int64) func() {
	if tokens <= 0 {
		return func() {}
	}
	k := heldKey{service, ep}
	pw.mu.Lock()
	if pw.m == nil {
		pw.m = make(map[heldKey]*workCount)
	}
	c := pw.m[k]
	if c == nil {
		c = &workCount{}
		pw.m[k] = c
	}
	c.tokens += tokens
	pw.mu.Unlock()
	var once sync.Once
	return func() {
		once.Do(func() {
			pw.mu.Lock()
			c.tokens -= tokens
			if c.tokens <= 0 && pw.m[k] == c {
				delete(pw.m, k)
			}
			pw.mu.Unlock()
		})
	}
}

// outstanding returns the prefill tokens outstanding on ep.
func (pw *prefillWork) outstanding(service uint32, ep int) int64 {
	pw.mu.Lock()
	defer pw.mu.Unlock()
	if c := pw.m[heldKey{service, ep}]; c != nil {
		return c.tokens
	}
	return 0
}

// forget drops a removed service's counts; releases of its requests still
// in flight then find nothing to subtract.
func (pw *prefillWork) forget(service uint32) {
	pw.mu.Lock()
	defer pw.mu.Unlock()
	for k := range pw.m {
		if k.service == service {
			delete(pw.m, k)
		}
	}
}
