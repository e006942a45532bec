package bench

import (
	"fmt"
	"html"
	"math"
	"strings"
)

var armColors = []string{"#9e9e9e", "#f0a030", "#2e7d32", "#1565c0", "#8e24aa", "#c62828"}

// niceMax rounds v up to 1, 2 or 5 times a power of ten.
func niceMax(v float64) float64 {
	if v <= 0 {
		return 1
	}
	p := math.Pow(10, math.Floor(math.Log10(v)))
	for _, m := range []float64{1, 2, 5, 10} {
		if m*p >= v {
			return m * p
		}
	}
	return 10 * p
}

// Chart renders one workload as an SVG: on the left the engines' cache hit
// ratio per arm against the offline bound, on the right TTFT p50/p90/p99 per
// arm (lower is better).
func Chart(w *WorkloadResult, f FleetConfig) string {
	const W, H = 980, 430
	const top, bottom = 92, 350
	var b strings.Builder
	fmt.Fprintf(&b, `<svg xmlns="http://www.w3.org/2000/svg" width="%d" height="%d" viewBox="0 0 %d %d" font-family="Helvetica,Arial,sans-serif" font-size="12">`+"\n", W, H, W, H)
	fmt.Fprintf(&b, `<rect width="%d" height="%d" fill="white"/>`+"\n", W, H)
	fmt.Fprintf(&b, `<text x="20" y="26" font-size="17" font-weight="bold">%s</text>`+"\n", html.EscapeString(w.Workload.Name+": "+w.Workload.Title))
	fmt.Fprintf(&b, `<text x="20" y="46" fill="#444" font-size="11">%s</text>`+"\n", html.EscapeString(w.Workload.Description))
	fmt.Fprintf(&b, `<text x="20" y="64" fill="#444" font-size="11">%s</text>`+"\n", html.EscapeString(fmt.Sprintf(
		"%s x %d tokens; prefill %.0f us/uncached token; decode %.0f ms/step; time scale %g",
		f.Describe(), f.BlockSize, f.PrefillUsPerToken, f.DecodeUsPerToken/1000, f.TimeScale)))
	n := len(w.Arms)
	// Left panel: hit ratio.
	lx, lw := 70.0, 330.0
	axis := func(x0, width, maxv float64, ticks int, format string, title string) {
		for i := 0; i <= ticks; i++ {
			v := maxv * float64(i) / float64(ticks)
			y := bottom - (bottom-top)*float64(i)/float64(ticks)
			fmt.Fprintf(&b, `<line x1="%.1f" y1="%.1f" x2="%.1f" y2="%.1f" stroke="#e0e0e0"/>`+"\n", x0, y, x0+width, y)
			fmt.Fprintf(&b, `<text x="%.1f" y="%.1f" text-anchor="end" fill="#555">`+format+`</text>`+"\n", x0-6, y+4, v)
		}
		fmt.Fprintf(&b, `<line x1="%.1f" y1="%d" x2="%.1f" y2="%d" stroke="#333"/>`+"\n", x0, bottom, x0+width, bottom)
		fmt.Fprintf(&b, `<text x="%.1f" y="%d" text-anchor="middle" font-weight="bold">%s</text>`+"\n", x0+width/2, top-10, html.EscapeString(title))
	}
	axis(lx, lw, 1, 5, "%.1f", "Cache hit ratio (engine counters), higher is better")
	slot := lw / float64(max(n, 1))
	for i, a := range w.Arms {
		h := (bottom - top) * a.HitRatio
		x := lx + slot*float64(i) + slot*0.2
		fmt.Fprintf(&b, `<rect x="%.1f" y="%.1f" width="%.1f" height="%.1f" fill="%s"><title>%s: %.3f</title></rect>`+"\n",
			x, bottom-h, slot*0.6, h, armColors[i%len(armColors)], html.EscapeString(a.Label), a.HitRatio)
		fmt.Fprintf(&b, `<text x="%.1f" y="%.1f" text-anchor="middle">%.2f</text>`+"\n", x+slot*0.3, bottom-h-4, a.HitRatio)
		fmt.Fprintf(&b, `<text x="%.1f" y="%d" text-anchor="middle">%s</text>`+"\n", x+slot*0.3, bottom+16, html.EscapeString(a.Arm))
	}
	bounds := []struct {
		v     float64
		label string
		dash  string
	}{{w.Bound.FleetLRU, "upper bound (fleet-size LRU)", "6,4"}, {w.Bound.Unbounded, "unbounded cache", "2,3"}}
	if math.Abs(w.Bound.Unbounded-w.Bound.FleetLRU) < 0.04 {
		// One label when the two bounds (nearly) coincide.
		bounds = bounds[:1]
		bounds[0].label = "upper bound (fleet-size LRU ~ unbounded)"
	}
	for _, bl := range bounds {
		y := bottom - (bottom-top)*bl.v
		fmt.Fprintf(&b, `<line x1="%.1f" y1="%.1f" x2="%.1f" y2="%.1f" stroke="#c62828" stroke-width="1.5" stroke-dasharray="%s"/>`+"\n", lx, y, lx+lw, y, bl.dash)
		fmt.Fprintf(&b, `<text x="%.1f" y="%.1f" fill="#c62828" font-size="11">%s %.2f</text>`+"\n", lx+lw+4, y+4, bl.label, bl.v)
	}
	// Right panel: TTFT percentiles.
	rx, rw := 640.0, 320.0
	maxT := 0.0
	for _, a := range w.Arms {
		maxT = math.Max(maxT, a.TTFTms.P99)
	}
	maxT = niceMax(maxT)
	axis(rx, rw, maxT, 5, "%.0f", "TTFT (ms), lower is better")
	slot = rw / float64(max(n, 1))
	shades := []struct {
		name string
		op   string
		get  func(a ArmResult) float64
	}{{"p50", "0.45", func(a ArmResult) float64 { return a.TTFTms.P50 }},
		{"p90", "1", func(a ArmResult) float64 { return a.TTFTms.P90 }},
		{"p99", "0.7", func(a ArmResult) float64 { return a.TTFTms.P99 }}}
	for i, a := range w.Arms {
		bw := slot * 0.8 / 3
		for j, s := range shades {
			v := s.get(a)
			h := (bottom - top) * v / maxT
			x := rx + slot*float64(i) + slot*0.1 + bw*float64(j)
			stroke := ""
			if s.name == "p99" {
				stroke = ` stroke="#333" stroke-dasharray="2,2"`
			}
			fmt.Fprintf(&b, `<rect x="%.1f" y="%.1f" width="%.1f" height="%.1f" fill="%s" fill-opacity="%s"%s><title>%s TTFT %s: %.1f ms</title></rect>`+"\n",
				x, bottom-h, bw-1, h, armColors[i%len(armColors)], s.op, stroke, html.EscapeString(a.Label), s.name, v)
			if s.name == "p90" {
				fmt.Fprintf(&b, `<text x="%.1f" y="%.1f" text-anchor="middle" font-size="10">%.0f</text>`+"\n", x+bw/2, bottom-h-4, v)
			}
		}
		fmt.Fprintf(&b, `<text x="%.1f" y="%d" text-anchor="middle">%s</text>`+"\n", rx+slot*float64(i)+slot/2, bottom+16, html.EscapeString(a.Arm))
	}
	if fl := w.Bound.TTFTFloorMs.P90; fl > 0 && fl <= maxT {
		y := bottom - (bottom-top)*fl/maxT
		fmt.Fprintf(&b, `<line x1="%.1f" y1="%.1f" x2="%.1f" y2="%.1f" stroke="#c62828" stroke-width="1.5" stroke-dasharray="6,4"/>`+"\n", rx, y, rx+rw, y)
		fmt.Fprintf(&b, `<text x="%.1f" y="%.1f" fill="#c62828" font-size="11" text-anchor="end">p90 floor (bound's hits, no queueing) %.0f ms</text>`+"\n", rx+rw, y-4, fl)
	}
	fmt.Fprintf(&b, `<text x="%.1f" y="%d" text-anchor="middle" fill="#555" font-size="11">bars per arm: p50 (light), p90 (solid, labelled), p99 (dashed outline)</text>`+"\n", rx+rw/2, bottom+32)
	// Legend.
	x := 20.0
	for i, a := range w.Arms {
		fmt.Fprintf(&b, `<rect x="%.1f" y="%d" width="12" height="12" fill="%s"/>`+"\n", x, H-28, armColors[i%len(armColors)])
		label := a.Label
		fmt.Fprintf(&b, `<text x="%.1f" y="%d">%s</text>`+"\n", x+16, H-18, html.EscapeString(label))
		x += 16 + 7*float64(len(label)) + 24
	}
	b.WriteString("</svg>\n")
	return b.String()
}
