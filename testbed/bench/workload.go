package bench

import (
	"fmt"
	"math"
	"math/rand/v2"
	"sort"
	"time"
)

// Req is one request of a workload: a completion whose prompt is token
// ids, or, when Chat is set, a chat completion whose Tokens are what the
// engines' chat template and tokenizer make of it (filled in by Run).
type Req struct {
	Tokens    []uint32
	Chat      *ChatBody
	MaxTokens int
	// Group names the prefix the request shares with others (prefix group,
	// chat session, sibling burst, hot-prefix id); -1 when none.
	Group int
	// Turn is the request's position in its chat session, 0 for the first
	// turn and for workloads without sessions. A first turn's history is
	// new by construction, so only later turns can hit a cached history:
	// the report gives their TTFT separately to show what routing controls.
	Turn int
}

// Stream is a sequence of requests of one client: the first at Start, each
// next one Think after the previous completed (closed loop), or, when
// Offsets is set, request k at Start + Offsets[k] whether or not the
// previous one is done (a fixed schedule, as trace replays use). An
// open-loop arrival process is many one-request streams.
type Stream struct {
	Start   time.Duration
	Think   time.Duration
	Offsets []time.Duration
	Reqs    []Req
}

// at is the nominal start of request k.
func (s Stream) at(k int) time.Duration {
	if s.Offsets != nil {
		return s.Start + s.Offsets[k]
	}
	return s.Start + time.Duration(k)*s.Think
}

// Workload is a seeded, deterministic set of streams.
type Workload struct {
	Name        string         `json:"name"`
	Title       string         `json:"title"`
	Description string         `json:"description"`
	Params      map[string]any `json:"params"`
	Streams     []Stream       `json:"-"`
}

// HasTurns reports whether the workload has chat sessions of more than one
// turn.
func (w Workload) HasTurns() bool {
	for _, s := range w.Streams {
		for _, r := range s.Reqs {
			if r.Turn > 0 {
				return true
			}
		}
	}
	return false
}

// Requests is the number of requests in the workload.
func (w Workload) Requests() int {
	n := 0
	for _, s := range w.Streams {
		n += len(s.Reqs)
	}
	return n
}

// Trace is the workload's requests in nominal arrival order (a closed-loop
// stream's k-th request at Start + k*Think), the order the offline bound
// replays.
func (w Workload) Trace() []Req {
	type item struct {
		at   time.Duration
		s, k int
		r    Req
	}
	var items []item
	for si, s := range w.Streams {
		for k, r := range s.Reqs {
			items = append(items, item{s.at(k), si, k, r})
		}
	}
	sort.SliceStable(items, func(i, j int) bool {
		if items[i].at != items[j].at {
			return items[i].at < items[j].at
		}
		if items[i].k != items[j].k {
			return items[i].k < items[j].k
		}
		return items[i].s < items[j].s
	})
	out := make([]Req, len(items))
	for i, it := range items {
		out[i] = it.r
	}
	return out
}

// tokenGen makes random token ids in a range every tokenizer of interest
// covers (Qwen3 has ~151k ids), so the prompts are valid for the engines.
type tokenGen struct{ r *rand.Rand }

func newTokenGen(seed uint64, stream uint64) *tokenGen {
	return &tokenGen{r: rand.New(rand.NewPCG(seed, stream))}
}

func (g *tokenGen) tokens(n int) []uint32 {
	out := make([]uint32, n)
	for i := range out {
		out[i] = 1000 + uint32(g.r.IntN(140000))
	}
	return out
}

func concat(parts ...[]uint32) []uint32 {
	n := 0
	for _, p := range parts {
		n += len(p)
	}
	out := make([]uint32, 0, n)
	for _, p := range parts {
		out = append(out, p...)
	}
	return out
}

// poisson returns n arrival offsets of a Poisson process at rate per second.
func poisson(r *rand.Rand, n int, rate float64) []time.Duration {
	out := make([]time.Duration, n)
	var t float64
	for i := range out {
		out[i] = time.Duration(t * float64(time.Second))
		t += r.ExpFloat64() / rate
	}
	return out
}

// SharedPrefixSpec is the llm-d "shared_prefix" shape: groups of prompts
// that share a long system prompt, each with its own question.
type SharedPrefixSpec struct {
	Groups, PerGroup   int
	SystemTokens       int
	QuestionTokens     int
	OutputTokens       int
	RatePerSec         float64
	FillOfFleetPercent int // documentation only: system prompts as % of fleet KV
}

// SharedPrefix builds the workload: every group's prompts are shuffled
// together and arrive as a Poisson process.
func SharedPrefix(name string, seed uint64, s SharedPrefixSpec) Workload {
	g := newTokenGen(seed, 1)
	systems := make([][]uint32, s.Groups)
	for i := range systems {
		systems[i] = g.tokens(s.SystemTokens)
	}
	var reqs []Req
	for gi := 0; gi < s.Groups; gi++ {
		for p := 0; p < s.PerGroup; p++ {
			reqs = append(reqs, Req{Tokens: concat(systems[gi], g.tokens(s.QuestionTokens)), MaxTokens: s.OutputTokens, Group: gi})
		}
	}
	g.r.Shuffle(len(reqs), func(i, j int) { reqs[i], reqs[j] = reqs[j], reqs[i] })
	at := poisson(g.r, len(reqs), s.RatePerSec)
	w := Workload{Name: name,
		Title: fmt.Sprintf("Shared prefix, system prompts = %d%% of fleet KV", s.FillOfFleetPercent),
		Description: fmt.Sprintf("%d groups x %d prompts, %d-token system prompt + %d-token question, %d output tokens, Poisson %.0f req/s",
			s.Groups, s.PerGroup, s.SystemTokens, s.QuestionTokens, s.OutputTokens, s.RatePerSec),
		Params: map[string]any{"groups": s.Groups, "per_group": s.PerGroup, "system_tokens": s.SystemTokens,
			"question_tokens": s.QuestionTokens, "output_tokens": s.OutputTokens, "rate_per_sec": s.RatePerSec,
			"system_prompts_percent_of_fleet_kv": s.FillOfFleetPercent}}
	for i, r := range reqs {
		w.Streams = append(w.Streams, Stream{Start: at[i], Reqs: []Req{r}})
	}
	return w
}

// MultiTurnSpec is a multi-round chat: users share a system prompt and each
// user's history grows by a question and an answer every round.
type MultiTurnSpec struct {
	Users, Turns int
	SystemTokens int
	// UserContextTokens is a per-user prompt placed after the shared
	// system prompt (production-stack multi-round-qa's user history
	// prompt: a profile, a document, earlier sessions); 0 for none.
	UserContextTokens int
	QuestionTokens    int
	AnswerTokens      int // tokens of the previous answer appended to the history
	OutputTokens      int
	// Interval is the mean time between a user's turns, drawn uniformly
	// from [0.5, 1.5] x Interval and fixed in advance, so the offered rate
	// is Users/Interval whatever the latency, as a trace replay offers it
	// (the jitter keeps round robin from locking users onto endpoints).
	Interval time.Duration
	Stagger  time.Duration // users start Stagger apart
}

// MultiTurn builds the workload: one fixed-schedule stream per user.
func MultiTurn(name string, seed uint64, s MultiTurnSpec) Workload {
	g := newTokenGen(seed, 2)
	system := g.tokens(s.SystemTokens)
	w := Workload{Name: name, Title: "Multi-turn chat, growing history",
		Description: fmt.Sprintf("%d users x %d turns, shared %d-token system prompt + %d-token user context, +%d question +%d answer tokens per turn, a turn every %v per user (%.0f req/s)",
			s.Users, s.Turns, s.SystemTokens, s.UserContextTokens, s.QuestionTokens, s.AnswerTokens, s.Interval, float64(s.Users)/s.Interval.Seconds()),
		Params: map[string]any{"users": s.Users, "turns": s.Turns, "system_tokens": s.SystemTokens, "user_context_tokens": s.UserContextTokens,
			"question_tokens": s.QuestionTokens, "answer_tokens": s.AnswerTokens, "output_tokens": s.OutputTokens,
			"interval_ms": s.Interval.Milliseconds(), "stagger_ms": s.Stagger.Milliseconds()}}
	for u := 0; u < s.Users; u++ {
		st := Stream{Start: time.Duration(u) * s.Stagger}
		hist := system
		if s.UserContextTokens > 0 {
			hist = concat(system, g.tokens(s.UserContextTokens))
		}
		var off time.Duration
		for t := 0; t < s.Turns; t++ {
			if t > 0 {
				off += s.Interval/2 + time.Duration(g.r.Int64N(int64(s.Interval)+1))
			}
			st.Offsets = append(st.Offsets, off)
			if t > 0 {
				hist = concat(hist, g.tokens(s.AnswerTokens))
			}
			hist = concat(hist, g.tokens(s.QuestionTokens))
			st.Reqs = append(st.Reqs, Req{Tokens: hist, MaxTokens: s.OutputTokens, Group: u, Turn: t})
		}
		w.Streams = append(w.Streams, st)
	}
	return w
}

// SiblingSpec is best-of-N / agent fan-out: bursts of siblings that share a
// prefix no engine has seen, arriving within milliseconds.
type SiblingSpec struct {
	Bursts, Siblings int
	PrefixTokens     int
	QuestionTokens   int
	OutputTokens     int
	BurstGap         time.Duration // between bursts
	MaxSpread        time.Duration // siblings of a burst arrive within this
}

// SiblingBursts builds the workload.
func SiblingBursts(name string, seed uint64, s SiblingSpec) Workload {
	g := newTokenGen(seed, 3)
	w := Workload{Name: name, Title: "Sibling bursts sharing a new prefix",
		Description: fmt.Sprintf("%d bursts x %d siblings within %v, new %d-token prefix + %d-token suffix each, bursts %v apart",
			s.Bursts, s.Siblings, s.MaxSpread, s.PrefixTokens, s.QuestionTokens, s.BurstGap),
		Params: map[string]any{"bursts": s.Bursts, "siblings": s.Siblings, "prefix_tokens": s.PrefixTokens,
			"question_tokens": s.QuestionTokens, "output_tokens": s.OutputTokens,
			"burst_gap_ms": s.BurstGap.Milliseconds(), "max_spread_ms": s.MaxSpread.Milliseconds()}}
	for b := 0; b < s.Bursts; b++ {
		prefix := g.tokens(s.PrefixTokens)
		base := time.Duration(b) * s.BurstGap
		for i := 0; i < s.Siblings; i++ {
			off := time.Duration(g.r.Int64N(int64(s.MaxSpread) + 1))
			w.Streams = append(w.Streams, Stream{Start: base + off,
				Reqs: []Req{{Tokens: concat(prefix, g.tokens(s.QuestionTokens)), MaxTokens: s.OutputTokens, Group: b}}})
		}
	}
	sort.SliceStable(w.Streams, func(i, j int) bool { return w.Streams[i].Start < w.Streams[j].Start })
	return w
}

// HotPrefixSpec is a skewed prefix popularity: one prefix takes HotShare of
// the traffic and the rest follow Zipf(ZipfS) over the other prefixes.
type HotPrefixSpec struct {
	Prefixes, Requests int
	HotShare           float64
	ZipfS              float64
	PrefixTokens       int
	QuestionTokens     int
	OutputTokens       int
	RatePerSec         float64
}

// HotPrefix builds the workload.
func HotPrefix(name string, seed uint64, s HotPrefixSpec) Workload {
	g := newTokenGen(seed, 4)
	prefixes := make([][]uint32, s.Prefixes)
	for i := range prefixes {
		prefixes[i] = g.tokens(s.PrefixTokens)
	}
	// Zipf weights over prefixes 1..n-1.
	weights := make([]float64, s.Prefixes)
	var sum float64
	for i := 1; i < s.Prefixes; i++ {
		weights[i] = 1 / math.Pow(float64(i), s.ZipfS)
		sum += weights[i]
	}
	pick := func() int {
		if s.Prefixes == 1 || g.r.Float64() < s.HotShare {
			return 0
		}
		x := g.r.Float64() * sum
		for i := 1; i < s.Prefixes; i++ {
			x -= weights[i]
			if x <= 0 {
				return i
			}
		}
		return s.Prefixes - 1
	}
	at := poisson(g.r, s.Requests, s.RatePerSec)
	w := Workload{Name: name, Title: "Hot prefix (skewed popularity)",
		Description: fmt.Sprintf("%d requests over %d prefixes of %d tokens, %.0f%% on one prefix and Zipf(%.1f) over the rest, Poisson %.0f req/s",
			s.Requests, s.Prefixes, s.PrefixTokens, 100*s.HotShare, s.ZipfS, s.RatePerSec),
		Params: map[string]any{"prefixes": s.Prefixes, "requests": s.Requests, "hot_share": s.HotShare, "zipf_s": s.ZipfS,
			"prefix_tokens": s.PrefixTokens, "question_tokens": s.QuestionTokens, "output_tokens": s.OutputTokens,
			"rate_per_sec": s.RatePerSec}}
	for i := 0; i < s.Requests; i++ {
		p := pick()
		w.Streams = append(w.Streams, Stream{Start: at[i],
			Reqs: []Req{{Tokens: concat(prefixes[p], g.tokens(s.QuestionTokens)), MaxTokens: s.OutputTokens, Group: p}}})
	}
	return w
}
