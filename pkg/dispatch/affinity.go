package dispatch

import (
	"container/list"
	"sync"
	"time"
)

// sessions maps a session id (the rule's session header value) to the
// prefill and decode endpoints that served it, so a conversation keeps its
// KV cache. Bounded LRU with a TTL from the last use.
type sessions struct {
	mu    sync.Mutex
	ttl   time.Duration
	max   int
	ll    *list.List // front = most recent
	items map[sessionKey]*list.Element
	now   func() time.Time
}

type sessionKey struct {
	service uint32
	id      string
}

type sessionEntry struct {
	key             sessionKey
	prefill, decode int
	expires         time.Time
}

func newSessions(ttl time.Duration, max int, now func() time.Time) *sessions {
	return &sessions{ttl: ttl, max: max, ll: list.New(), items: make(map[sessionKey]*list.Element), now: now}
}

// get returns the session's endpoints; ok is false for unknown or expired.
func (s *sessions) get(service uint32, id string) (prefill, decode int, ok bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	el := s.items[sessionKey{service, id}]
	if el == nil {
		return 0, 0, false
	}
	e := el.Value.(*sessionEntry)
	if s.now().After(e.expires) {
		s.ll.Remove(el)
		delete(s.items, e.key)
		return 0, 0, false
	}
	return e.prefill, e.decode, true
}

// put records (or refreshes) the session and evicts expired and excess entries.
func (s *sessions) put(service uint32, id string, prefill, decode int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	k := sessionKey{service, id}
	now := s.now()
	if el := s.items[k]; el != nil {
		e := el.Value.(*sessionEntry)
		e.prefill, e.decode, e.expires = prefill, decode, now.Add(s.ttl)
		s.ll.MoveToFront(el)
	} else {
		s.items[k] = s.ll.PushFront(&sessionEntry{key: k, prefill: prefill, decode: decode, expires: now.Add(s.ttl)})
	}
	for s.ll.Len() > 0 {
		back := s.ll.Back()
		e := back.Value.(*sessionEntry)
		if s.ll.Len() <= s.max && now.Before(e.expires) {
			break
		}
		s.ll.Remove(back)
		delete(s.items, e.key)
	}
}

func (s *sessions) len() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.ll.Len()
}

func (s *sessions) forget(service uint32) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for k, el := range s.items {
		if k.service == service {
			s.ll.Remove(el)
			delete(s.items, k)
		}
	}
}

// prefixIndex is the routing-history prefix tier: it remembers which
// prefill endpoint each chained block key was last sent to. Because a key
// is a hash of its whole prefix (block keys, or the prompt-chunk chain),
// "key i present" means "this exact prefix up to block i was routed there",
// so a flat map walked in prompt order is a radix trie over the prefixes.
// Bounded per service; the oldest insertions are evicted first (a ring).
type prefixIndex struct {
	mu   sync.Mutex
	max  int
	svcs map[uint32]*prefixTable
	size int
}

type prefixTable struct {
	eps  map[uint64]int
	ring []uint64 // insertion order, for eviction
	head int
}

func newPrefixIndex(max int) *prefixIndex {
	return &prefixIndex{max: max, svcs: make(map[uint32]*prefixTable)}
}

// match returns the endpoint holding the longest routed prefix of keys and
// how many leading keys it covers; depth 0 means no history.
func (p *prefixIndex) match(service uint32, keys []uint64) (ep, depth int) {
	p.mu.Lock()
	defer p.mu.Unlock()
	t := p.svcs[service]
	if t == nil {
		return -1, 0
	}
	ep = -1
	for i, k := range keys {
		e, ok := t.eps[k]
		if !ok {
			break
		}
		ep, depth = e, i+1
	}
	return ep, depth
}

// insert records that keys were routed to ep.
func (p *prefixIndex) insert(service uint32, keys []uint64, ep int) {
	if len(keys) == 0 {
		return
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	t := p.svcs[service]
	if t == nil {
		t = &prefixTable{eps: make(map[uint64]int)}
		p.svcs[service] = t
	}
	for _, k := range keys {
		if _, ok := t.eps[k]; ok {
			t.eps[k] = ep
			continue
		}
		if len(t.eps) >= p.max {
			// Evict the oldest key still present.
			for len(t.ring) > 0 {
				old := t.ring[t.head]
				t.head = (t.head + 1) % len(t.ring)
				if _, ok := t.eps[old]; ok {
					delete(t.eps, old)
					p.size--
					break
				}
			}
		}
		t.eps[k] = ep
		p.size++
		if len(t.ring) < p.max {
			t.ring = append(t.ring, k)
		} else {
			// The ring is full: overwrite the slot just freed (head-1).
			t.ring[(t.head+len(t.ring)-1)%len(t.ring)] = k
		}
	}
}

func (p *prefixIndex) keys() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.size
}

func (p *prefixIndex) forget(service uint32) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if t := p.svcs[service]; t != nil {
		p.size -= len(t.eps)
		delete(p.svcs, service)
	}
}
