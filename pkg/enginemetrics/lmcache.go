package enginemetrics

import (
	"bufio"
	"bytes"
	"math"
	"strconv"

	"github.com/prometheus/client_golang/prometheus"
)

// LMCache exports its own lmcache:* series from the engine's /metrics.
// lmcache:num_hit_tokens is the authoritative hit counter (prometheus
// client libraries may expose it with a _total suffix); its companion
// lmcache:retrieve_hit_rate is a gauge that goes stale (it can read 1.0
// with no retrieves), so it is never read.
var lmcacheHitNames = []string{"lmcache:num_hit_tokens", "lmcache:num_hit_tokens_total"}

// lmcacheHitTokens returns the sum over label sets of the first LMCache
// hit-token counter present in text, and whether one was; a sample that
// is NaN, infinite or negative makes it report none.
func lmcacheHitTokens(text []byte) (float64, bool) {
	if !bytes.Contains(text, []byte("lmcache:num_hit_tokens")) {
		return 0, false
	}
	sums := map[string]float64{}
	sc := bufio.NewScanner(bytes.NewReader(text))
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		name, val, ok := sampleLine(sc.Bytes())
		if !ok || (name != lmcacheHitNames[0] && name != lmcacheHitNames[1]) {
			continue
		}
		v, err := strconv.ParseFloat(val, 64)
		if err != nil || math.IsNaN(v) || math.IsInf(v, 0) || v < 0 {
			return 0, false
		}
		sums[name] += v
	}
	for _, n := range lmcacheHitNames {
		if v, ok := sums[n]; ok {
			return v, true
		}
	}
	return 0, false
}

// lmcacheObserve turns one scrape's hit counter into the increase of
// loxilb_kv_lmcache_hit_tokens_total for k: the delta since the previous
// scrape, the whole value after an engine restart (the counter went
// down), nothing on the first scrape (the engine's history before the
// gateway watched it is not this gateway's to count). s.mu must be held.
func (s *Scraper) lmcacheObserve(k epKey, v float64) {
	last, seen := s.lmLast[k]
	s.lmLast[k] = v
	if !seen {
		return
	}
	d := v - last
	if d < 0 {
		d = v
	}
	if d > 0 {
		s.lmHits.WithLabelValues(strconv.FormatUint(uint64(k.service), 10), strconv.Itoa(k.ep)).Add(d)
	}
}

func newLMCacheHits() *prometheus.CounterVec {
	return prometheus.NewCounterVec(prometheus.CounterOpts{Name: "loxilb_kv_lmcache_hit_tokens_total",
		Help: "Prompt tokens an endpoint's LMCache tier served, from the deltas of its lmcache:num_hit_tokens counter (lmcache:retrieve_hit_rate is stale and ignored)."},
		[]string{"service", "ep_idx"})
}
