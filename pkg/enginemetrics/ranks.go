package enginemetrics

import (
	"bufio"
	"bytes"
	"strconv"
	"time"

	"github.com/loxilb-llm/loxilb/pkg/engine"
)

// Scrape error reasons of per-rank gauges (loxilb_gateway_engine_scrape_errors_total).
// The endpoint's own load signals are still used when its per-rank ones
// are refused.
const (
	// rankBadLabel: a rank label that is not an integer within
	// 0..engine.MaxDPRanks-1.
	rankBadLabel = "bad_rank_label"
	// rankBadValue: a per-rank running/waiting gauge that is NaN,
	// infinite, negative or above 2^20.
	rankBadValue = "bad_rank_value"
)

// rankSample is one scrape's per-rank running and waiting requests.
type rankSample struct {
	running, waiting [engine.MaxDPRanks]int
	ok               bool   // at least one per-rank gauge was read
	bad              string // why the per-rank gauges were refused, "" if not
}

// parseRankLoad reads the per-rank running and waiting gauges of an engine
// whose schedulers label them with their data-parallel rank (SGLang's
// dp_rank): the first of the engine's running (and waiting) names present
// with that label, the largest value per rank (the tensor-parallel
// workers of one rank report the same scheduler). A rank label or value
// out of range refuses them all, with the reason.
func parseRankLoad(engineName string, text []byte) rankSample {
	var out rankSample
	spec, ok := engine.Lookup(engineName)
	names, known := engineMetricNames[engineName]
	if !ok || !known || spec.Rank.LoadLabel == "" {
		return out
	}
	label := spec.Rank.LoadLabel
	// Which series each name feeds: 1 running, 2 waiting; the first name
	// of a list that appears with the label wins.
	kind := map[string]int{}
	for _, n := range names.running {
		kind[n] = 1
	}
	for _, n := range names.waiting {
		kind[n] = 2
	}
	var chosen [3]string
	sc := bufio.NewScanner(bytes.NewReader(text))
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		line := sc.Bytes()
		name, val, ok := sampleLine(line)
		if !ok {
			continue
		}
		k := kind[name]
		if k == 0 {
			continue
		}
		rv, has := labelValue(line, label)
		if !has {
			continue
		}
		if chosen[k] == "" {
			chosen[k] = name
		} else if chosen[k] != name {
			continue
		}
		r, err := strconv.Atoi(rv)
		if err != nil || r < 0 || r >= engine.MaxDPRanks {
			return rankSample{bad: rankBadLabel}
		}
		v, err := strconv.ParseFloat(val, 64)
		if err != nil || checkCount(name, v) != nil {
			return rankSample{bad: rankBadValue}
		}
		dst := &out.running
		if k == 2 {
			dst = &out.waiting
		}
		dst[r] = max(dst[r], int(v))
		out.ok = true
	}
	return out
}

// labelValue returns the value of label in a Prometheus text sample line
// (escapes left as sent: rank values have none); has is false when the
// line has no such label or its label set is malformed.
func labelValue(line []byte, label string) (string, bool) {
	open := bytes.IndexByte(line, '{')
	if open < 0 {
		return "", false
	}
	rest := line[open+1:]
	for len(rest) > 0 {
		rest = bytes.TrimLeft(rest, " ,")
		if len(rest) == 0 || rest[0] == '}' {
			return "", false
		}
		eq := bytes.IndexByte(rest, '=')
		if eq <= 0 || eq+1 >= len(rest) || rest[eq+1] != '"' {
			return "", false
		}
		name := bytes.TrimSpace(rest[:eq])
		v := rest[eq+2:]
		end := -1
		for i := 0; i < len(v); i++ {
			if v[i] == '\\' {
				i++
				continue
			}
			if v[i] == '"' {
				end = i
				break
			}
		}
		if end < 0 {
			return "", false
		}
		if string(name) == label {
			return string(v[:end]), true
		}
		rest = v[end+1:]
	}
	return "", false
}

// RankMetrics copies the per-rank running and waiting gauges of ep's last
// fresh scrape into running and waiting; false without one, or when the
// engine labels no gauge with its rank.
func (s *Scraper) RankMetrics(service uint32, ep int, running, waiting []int) bool {
	s.mu.RLock()
	smp, ok := s.samples[epKey{service, ep}]
	s.mu.RUnlock()
	if !ok || !smp.ranks.ok || time.Since(smp.at) > s.cfg.MaxAge {
		return false
	}
	copy(running, smp.ranks.running[:])
	copy(waiting, smp.ranks.waiting[:])
	return true
}
