package gateway

import "time"

// Rank seeding: what moving a request to a data-parallel rank that holds
// none of it costs, and when that is worth it.
//
// The ranks of an endpoint are separate caches. A prompt whose shared
// part (a system prompt and tool definitions) is long against its own
// text ties with no other rank, so every such request went to the rank
// that cached the shared part first: on an SGLang fleet of two ranks per
// engine, agent loops put all their sessions on one rank per engine
// (over 90% of their requests) and its cache churned while the sibling's
// stayed empty. Round robin over the ranks would throw away long
// histories instead.
//
// So a rank that holds none of the request is seeded the way the router
// seeds a cold endpoint (pkg/router, movecost.go): the request goes there
// when the rank has fewer requests in flight than the pick (the pick has
// a queue the seed avoids; recent placements alone do not count, so
// requests one after another on an idle engine keep their prefix) and the
// cached prefix it throws away is no longer than the service's median
// cached prefix (Router.SeedLoss), so a typical new prompt pays once to
// warm the rank, never the long tail of a session. Once the rank holds
// the shared part, later prompts after it tie and spread by load, and
// sessions stay on their history: a rank that holds any of the request is
// not cold for it. loxilb_kv_rank_seeds_total counts the seeds.

// lighter reports whether rank a is less loaded than rank b: fewer
// requests in flight, then fewer recent placements.
func (s *rankSnapshot) lighter(a, b int) bool {
	return s.load[a] < s.load[b] || s.load[a] == s.load[b] && s.placed[a] < s.placed[b]
}

// seedRank returns the rank to send a request to instead of pick: the
// rank with the fewest requests in flight, fewer than pick's, that holds
// none of the request (depth 0), when pick's prefix is at most s.seedLoss
// blocks (s.seeded is then set); else pick. depth is every rank's cached
// prefix of the request. A nil s (no load known) keeps pick.
func (s *rankSnapshot) seedRank(depth []int, pick int) int {
	if s == nil || depth[pick] == 0 || depth[pick] > s.seedLoss {
		return pick
	}
	seed := pick
	for r := range depth {
		if depth[r] == 0 && s.load[r] < s.load[seed] {
			seed = r
		}
	}
	s.seeded = seed != pick
	return seed
}

// rankView is what chooseRank reads of endpoint ep of st with ranks ranks
// at now: the per-rank load and placements, and the rank seed's price in
// blocks of the rule.
func (g *Gateway) rankView(st *service, ep, ranks int, now time.Time, lv *rankSnapshot) {
	g.ranks.snapshot(st.id, ep, ranks, g.cfg.SpeculativeTTL, now, g.rankEngine, lv)
	if bs := st.hasher.BlockSize(); bs > 0 {
		lv.seedLoss = int(g.router.SeedLoss(st.id)) / bs
	}
}
