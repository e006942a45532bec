package gateway

import (
	"bytes"
	"net/http"
	"strconv"

	"github.com/loxilb-llm/loxilb/pkg/engine"
	"github.com/loxilb-llm/loxilb/pkg/proxy"
)

// RankInventory is implemented by inventories that know which
// data-parallel rank of an endpoint holds each block (*kvindex.Index).
// RankPrefixMatch sets out[r] to the cached prefix length of rank r of
// endpoint ep; it must be safe for concurrent use and not retain its
// arguments.
type RankInventory interface {
	RankPrefixMatch(service uint32, ep int, keys []uint64, out []int)
}

// rankTargeting is how a rule's requests name a data-parallel rank; nil
// when the rule's engines have one rank or cannot be told one.
type rankTargeting struct {
	ranks  int
	target engine.RankTarget
}

func newRankTargeting(engineName string, ranks int) *rankTargeting {
	spec, ok := engine.Lookup(engineName)
	if !ok || ranks < 2 || !spec.Rank.Targets() {
		return nil
	}
	ranks = min(ranks, engine.MaxDPRanks)
	return &rankTargeting{ranks: ranks, target: spec.Rank}
}

// rankChoice is the rank chooseRank picked and what it holds of the
// request.
type rankChoice struct {
	rank int
	// best is the blocks of the request the endpoint's deepest rank
	// holds: rankLoad.begin remembers the placement by the blocks after
	// them.
	best int
	// held is the blocks of the request the chosen rank holds, or will
	// hold once the request it followed has computed them: the prefix the
	// engine serves from cache there. It is below best when a shallower
	// rank was chosen for its load or seeded, and the request's prefill
	// work is then its prompt minus held, not minus best.
	held int
}

// chooseRank returns the rank of endpoint ep to send keys to. The rank is
// the one holding the longest prefix, unless a
// shallower rank would cost the request no more extra prefill than it
// needs anyway: ranks whose prefix falls short of the longest by at most
// the request's uncached blocks on the deepest rank count as tied. Among
// tied ranks:
//
//  1. the rank of a request placed within the speculative TTL (lv's
//     placements) that had the same prompt up to at least the middle of
//     this request's uncached blocks, so requests sharing most of what
//     they need computed meet on one rank before the engine's events say
//     it holds it (siblings of a new prompt, a session's next turn whose
//     previous turn's events lag), while requests sharing only a short
//     prefix (a system prompt before a long conversation) do not;
//  2. else the rank with the fewest requests in flight (lv's load), then
//     the fewest recent placements;
//  3. else the rank the first block the deepest rank lacks hashes to.
//
// Unless it followed a placement (1), the request then seeds a cold rank
// when that is cheap (seedRank): a rank holding none of it, less loaded
// than the pick, takes it if the pick's cached prefix is no longer than
// lv.seedLoss.
//
// So a session whose history is long against its new turn stays on its
// rank (no other rank ties), and new documents or conversations whose own
// text is long against a shared system prompt spread over the ranks by
// load. Preferring the deepest rank outright sent every request sharing a
// system prompt to the rank that cached it first (an endpoint of two
// ranks cached like one); the hash alone left sessions that start
// together to chance, three or four of an engine's sessions on one rank
// whose cache then churned while its sibling's had room. lv may be nil
// (no load known: the hash decides).
func chooseRank(inv RankInventory, service uint32, ep int, ranks int, keys []uint64, lv *rankSnapshot) rankChoice {
	var depth [engine.MaxDPRanks]int
	inv.RankPrefixMatch(service, ep, keys, depth[:ranks])
	best := 0
	for r := 0; r < ranks; r++ {
		best = max(best, depth[r])
	}
	choice := func(r int) rankChoice { return rankChoice{rank: r, best: best, held: depth[r]} }
	slack := len(keys) - best // the request's uncached blocks on the deepest rank
	var tied [engine.MaxDPRanks]int
	var isTied [engine.MaxDPRanks]bool
	n := 0
	for r := 0; r < ranks; r++ {
		if best-depth[r] <= slack {
			tied[n] = r
			isTied[r] = true
			n++
		}
	}
	if n == 1 {
		return choice(lv.seedRank(depth[:ranks], tied[0]))
	}
	// A request sharing at least half of its uncached blocks with one
	// placed a moment ago meets it, and finds there the blocks that one
	// shares with it once they are computed.
	if r, at, ok := lv.follow(keys, best+slack/2); ok && r < ranks && isTied[r] {
		c := choice(r)
		c.held = max(c.held, at+1)
		return c
	}
	k := keys[min(best, len(keys)-1)]
	k ^= k >> 33
	k *= 0xff51afd7ed558ccd
	k ^= k >> 33
	h := int(k % uint64(n))
	if lv == nil {
		return choice(tied[h])
	}
	pick := tied[h]
	for i := 1; i < n; i++ {
		r := tied[(h+i)%n]
		if lv.lighter(r, pick) {
			pick = r
		}
	}
	return choice(lv.seedRank(depth[:ranks], pick))
}

// targetEndpoint returns ep rewritten to name rank to its engine: the rank fields
// appended to the request body, or the rank header. ok is false when the
// body is not a JSON object this function can extend; the request then
// goes as the client sent it and the engine's balancer picks the rank.
func (rt *rankTargeting) targetEndpoint(ep proxy.Endpoint, rank int, body []byte) (proxy.Endpoint, bool) {
	if len(rt.target.BodyFields) > 0 {
		b, ok := appendFields(body, rt.target.BodyFields, rank)
		if !ok {
			return ep, false
		}
		ep.Body = b
	}
	if rt.target.Header != "" {
		ep.Header = http.Header{http.CanonicalHeaderKey(rt.target.Header): {strconv.Itoa(rank)}}
	}
	return ep, true
}

// appendFields adds "field":value for every field at the end of the JSON
// object body, without decoding it: the tokenizer has already parsed the
// body as an object. The engines' JSON decoders keep the last of duplicate
// keys, so a rank the client named is overridden.
func appendFields(body []byte, fields []string, value int) ([]byte, bool) {
	end := len(bytes.TrimRight(body, " \t\r\n"))
	start := len(body) - len(bytes.TrimLeft(body, " \t\r\n"))
	if end-start < 2 || body[start] != '{' || body[end-1] != '}' {
		return nil, false
	}
	empty := len(bytes.TrimSpace(body[start+1:end-1])) == 0
	v := strconv.Itoa(value)
	out := make([]byte, 0, end+len(fields)*(len(v)+24)+1)
	out = append(out, body[:end-1]...)
	for i, f := range fields {
		if i > 0 || !empty {
			out = append(out, ',')
		}
		out = append(out, '"')
		out = append(out, f...)
		out = append(out, '"', ':')
		out = append(out, v...)
	}
	return append(out, '}'), true
}
