package bench

import "sort"

func median(v []float64) float64 {
	if len(v) == 0 {
		return 0
	}
	c := append([]float64(nil), v...)
	sort.Float64s(c)
	if len(c)%2 == 1 {
		return c[len(c)/2]
	}
	return (c[len(c)/2-1] + c[len(c)/2]) / 2
}

// medianRun folds repetitions of one arm: every scalar metric is the
// median over the runs (robust to one run disturbed by a noisy
// neighbour); the load distribution and receipts are those of the run
// whose TTFT p90 is the median; errors, spills and receipt tiers are
// summed. The per-run hit ratios and TTFT p90s are kept to show spread.
func medianRun(runs []ArmResult) ArmResult {
	if len(runs) == 1 {
		r := runs[0]
		r.Runs = 1
		r.HitRatioRuns, r.TTFTP90Runs = []float64{r.HitRatio}, []float64{r.TTFTms.P90}
		r.MaxOverMeanRuns = []float64{r.MaxOverMeanLoad}
		if r.TTFTLaterTurnsMs != nil {
			r.TTFTLaterTurnsP90Runs = []float64{r.TTFTLaterTurnsMs.P90}
		}
		return r
	}
	get := func(f func(ArmResult) float64) float64 {
		v := make([]float64, len(runs))
		for i, r := range runs {
			v[i] = f(r)
		}
		return median(v)
	}
	byP90 := append([]ArmResult(nil), runs...)
	sort.Slice(byP90, func(i, j int) bool { return byP90[i].TTFTms.P90 < byP90[j].TTFTms.P90 })
	out := byP90[len(byP90)/2]
	out.Runs = len(runs)
	out.HitRatio = get(func(r ArmResult) float64 { return r.HitRatio })
	out.TTFTms = Percentiles{Mean: get(func(r ArmResult) float64 { return r.TTFTms.Mean }),
		P50: get(func(r ArmResult) float64 { return r.TTFTms.P50 }),
		P90: get(func(r ArmResult) float64 { return r.TTFTms.P90 }),
		P99: get(func(r ArmResult) float64 { return r.TTFTms.P99 })}
	out.E2Ems = Percentiles{Mean: get(func(r ArmResult) float64 { return r.E2Ems.Mean }),
		P50: get(func(r ArmResult) float64 { return r.E2Ems.P50 }),
		P90: get(func(r ArmResult) float64 { return r.E2Ems.P90 }),
		P99: get(func(r ArmResult) float64 { return r.E2Ems.P99 })}
	if out.TTFTLaterTurnsMs != nil {
		late := func(f func(Percentiles) float64) func(ArmResult) float64 {
			return func(r ArmResult) float64 {
				if r.TTFTLaterTurnsMs == nil {
					return 0
				}
				return f(*r.TTFTLaterTurnsMs)
			}
		}
		out.TTFTLaterTurnsMs = &Percentiles{Mean: get(late(func(p Percentiles) float64 { return p.Mean })),
			P50: get(late(func(p Percentiles) float64 { return p.P50 })),
			P90: get(late(func(p Percentiles) float64 { return p.P90 })),
			P99: get(late(func(p Percentiles) float64 { return p.P99 }))}
	}
	out.ThroughputRPS = get(func(r ArmResult) float64 { return r.ThroughputRPS })
	out.OutputTokPerSec = get(func(r ArmResult) float64 { return r.OutputTokPerSec })
	out.MaxOverMeanLoad = get(func(r ArmResult) float64 { return r.MaxOverMeanLoad })
	out.EndpointsPerGroup = get(func(r ArmResult) float64 { return r.EndpointsPerGroup })
	out.Errors, out.Spills, out.Requests, out.PrefillQueued = 0, 0, 0, 0
	out.Cold, out.DuplicateLeaders, out.TieYielded, out.LoadSnapshots = 0, 0, 0, 0
	out.Tiers = map[string]int{}
	out.HitRatioRuns, out.TTFTP90Runs, out.MaxOverMeanRuns, out.TTFTLaterTurnsP90Runs = nil, nil, nil, nil
	for _, r := range runs {
		out.Errors += r.Errors
		out.Spills += r.Spills
		out.Cold += r.Cold
		out.DuplicateLeaders += r.DuplicateLeaders
		out.TieYielded += r.TieYielded
		out.LoadSnapshots += r.LoadSnapshots
		out.PrefillQueued += r.PrefillQueued
		out.Requests += r.Requests
		if out.FirstError == "" {
			out.FirstError = r.FirstError
		}
		for k, v := range r.Tiers {
			out.Tiers[k] += v
		}
		out.HitRatioRuns = append(out.HitRatioRuns, r.HitRatio)
		out.TTFTP90Runs = append(out.TTFTP90Runs, r.TTFTms.P90)
		out.MaxOverMeanRuns = append(out.MaxOverMeanRuns, r.MaxOverMeanLoad)
		if r.TTFTLaterTurnsMs != nil {
			out.TTFTLaterTurnsP90Runs = append(out.TTFTLaterTurnsP90Runs, r.TTFTLaterTurnsMs.P90)
		}
	}
	return out
}
