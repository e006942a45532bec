package main

import (
	"context"
	"fmt"
	"math"
	"os"
	"os/signal"
	"sort"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	"github.com/loxilb-llm/loxilb/api"
	"github.com/loxilb-llm/loxilb/api/client"
	"github.com/loxilb-llm/loxilb/pkg/lbrule"
)

// topSample is one reading of the daemon: its rules and its metrics.
type topSample struct {
	at     time.Time
	rules  api.LBList
	series []promSeries
}

func newTopCmd(g *globalOpts) *cobra.Command {
	var interval time.Duration
	var once bool
	cmd := &cobra.Command{
		Use:   "top [SERVICE]",
		Short: "Live view of services (by rule name or id; all rules without one) from the rule list and the metrics export",
		Long: `Shows, per service, request rate, status classes, latency and KV routing,
and per endpoint its state, traffic, KV inventory, hash parity and queues.
Rates are over the last interval. Reads only the API (rule list and
GET /netlox/v1/metrics: the export must be on, see "loxicmd set metrics").
--once prints one frame (two readings an interval apart) and exits.`,
		Args: cobra.MaximumNArgs(1),
		RunE: func(_ *cobra.Command, args []string) error {
			if interval < 100*time.Millisecond || interval > time.Hour {
				return usagef("--interval %v: must be within [100ms, 1h]", interval)
			}
			c, err := g.client()
			if err != nil {
				return err
			}
			want := ""
			if len(args) == 1 {
				want = args[0]
			}
			ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
			defer stop()
			prev, err := readTop(ctx, c)
			if err != nil {
				return err
			}
			for {
				select {
				case <-ctx.Done():
					return nil
				case <-time.After(interval):
				}
				cur, err := readTop(ctx, c)
				if err != nil {
					if ctx.Err() != nil {
						return nil
					}
					return err
				}
				f, err := buildTopFrame(prev, cur, want)
				if err != nil {
					return err
				}
				if once {
					if g.output == "json" {
						return printJSON(g, f)
					}
					printTopFrame(g, f)
					return nil
				}
				g.printf("\x1b[H\x1b[2J")
				printTopFrame(g, f)
				prev = cur
			}
		},
	}
	cmd.Flags().DurationVar(&interval, "interval", time.Second, "time between readings and redraws (rates are over it)")
	cmd.Flags().BoolVar(&once, "once", false, "print one frame and exit")
	return cmd
}

func readTop(ctx context.Context, c *client.Client) (topSample, error) {
	s := topSample{at: time.Now()}
	var err error
	if s.rules, err = c.ListLB(ctx); err != nil {
		return s, err
	}
	text, err := c.Metrics(ctx)
	if err != nil {
		return s, err
	}
	if s.series, err = parseExposition(text); err != nil {
		return s, fmt.Errorf("metrics export: %w", err)
	}
	return s, nil
}

// topFrame is what one screen shows (also its JSON form).
type topFrame struct {
	Time     time.Time    `json:"time"`
	Interval float64      `json:"interval_seconds"`
	Services []topService `json:"services"`
}

type topService struct {
	ID         uint32        `json:"service"`
	Name       string        `json:"name"`
	VIP        string        `json:"vip"`
	Port       int           `json:"port"`
	Protocol   string        `json:"protocol"`
	Mode       string        `json:"mode"`
	ReqRate    float64       `json:"requests_per_second"`
	Status     topStatus     `json:"status_per_second"`
	P95        *float64      `json:"p95_seconds,omitempty"` // nil: no request finished in the interval
	Hits       float64       `json:"kv_hits_per_second"`
	Spills     float64       `json:"kv_spills_per_second"`
	ColdSeeds  float64       `json:"kv_cold_seeds_per_second"`
	Misses     float64       `json:"kv_misses_per_second"`
	Coalesced  float64       `json:"kv_coalesced_per_second"`
	PDRate     float64       `json:"pd_requests_per_second"`
	PDShed     float64       `json:"pd_shed_per_second"`
	DPPackets  *float64      `json:"dataplane_packets_per_second,omitempty"` // nil: no eBPF data plane
	DPFlows    *float64      `json:"dataplane_flows_per_second,omitempty"`
	Endpoints  []topEndpoint `json:"endpoints"`
	hasKV, isD bool
}

type topStatus struct {
	S2xx float64 `json:"2xx"`
	S4xx float64 `json:"4xx"`
	S5xx float64 `json:"5xx"`
}

type topEndpoint struct {
	Index     int      `json:"ep_idx"`
	Address   string   `json:"address"`
	Role      string   `json:"role"`
	State     string   `json:"state"`
	Healthy   *bool    `json:"healthy,omitempty"`
	ReqRate   float64  `json:"requests_per_second"`
	Hits      float64  `json:"kv_hits_per_second"`
	Blocks    *float64 `json:"kv_blocks,omitempty"`
	Parity    string   `json:"kv_parity,omitempty"`
	Events    string   `json:"kv_events,omitempty"` // connected, disconnected, degraded, quarantined
	Predicted float64  `json:"predicted_cached_tokens_per_second"`
	Reported  float64  `json:"reported_cached_tokens_per_second"`
	Waiting   float64  `json:"prefill_waiting"`
	Inflight  float64  `json:"pd_legs_inflight"`
}

// buildTopFrame computes rates between two readings for the rule named or
// numbered want (every rule when empty).
func buildTopFrame(prev, cur topSample, want string) (topFrame, error) {
	dt := cur.at.Sub(prev.at).Seconds()
	f := topFrame{Time: cur.at.UTC().Truncate(time.Second), Interval: math.Round(dt*1000) / 1000}
	var found bool
	for _, r := range cur.rules.LBAttr {
		id := strconv.FormatUint(uint64(r.ServiceID), 10)
		if want != "" && want != id && want != r.Service.Name {
			continue
		}
		found = true
		f.Services = append(f.Services, buildTopService(prev.series, cur.series, dt, r))
	}
	if want != "" && !found {
		names := []string{}
		for _, r := range cur.rules.LBAttr {
			n := strconv.FormatUint(uint64(r.ServiceID), 10)
			if r.Service.Name != "" {
				n += " (" + r.Service.Name + ")"
			}
			names = append(names, n)
		}
		if len(names) == 0 {
			names = append(names, "none")
		}
		return f, usagef("no service %q: rules are %s", want, strings.Join(names, ", "))
	}
	return f, nil
}

func buildTopService(prev, cur []promSeries, dt float64, r lbrule.Rule) topService {
	id := strconv.FormatUint(uint64(r.ServiceID), 10)
	s := topService{ID: r.ServiceID, Name: r.Service.Name, VIP: r.Service.ExternalIP, Port: r.Service.Port,
		Protocol: r.Service.Protocol, Mode: lbrule.ModeName(r.Service.Mode)}
	svc := map[string]string{"service": id}
	rate := func(name string, m map[string]string) float64 {
		return counterRate(prev, cur, name, m, dt)
	}
	s.ReqRate = rate("loxilb_ai_requests_total", svc)
	for _, x := range cur {
		if x.name != "loxilb_ai_requests_total" || x.labels["service"] != id {
			continue
		}
		v := rate("loxilb_ai_requests_total", x.labels)
		switch st := x.labels["status"]; {
		case strings.HasPrefix(st, "2"):
			s.Status.S2xx += v
		case strings.HasPrefix(st, "4"):
			s.Status.S4xx += v
		case strings.HasPrefix(st, "5"):
			s.Status.S5xx += v
		}
	}
	if q, ok := histogramQuantile(0.95, prev, cur, "loxilb_ai_request_duration_seconds", svc); ok {
		s.P95 = &q
	}
	s.Hits = rate("loxilb_pd_kv_tier15_hits_total", svc)
	s.Spills = rate("loxilb_pd_kv_tier15_spills_total", svc)
	s.ColdSeeds = rate("loxilb_pd_kv_tier15_cold_seeds_total", svc)
	s.Misses = rate("loxilb_pd_kv_tier15_miss_reason_total", svc)
	s.Coalesced = rate("loxilb_kv_coalesced_total", svc)
	s.PDRate = rate("loxilb_ai_pd_requests_total", svc)
	s.PDShed = rate("loxilb_pd_admission_shed_total", svc)
	s.hasKV, s.isD = r.Service.KVExactMode != 0, r.Service.PDDisagg
	if has(cur, "loxilb_dataplane_service_packets_total", svc) {
		p, fl := rate("loxilb_dataplane_service_packets_total", svc), rate("loxilb_dataplane_service_flows_total", svc)
		s.DPPackets, s.DPFlows = &p, &fl
	}
	for i, ep := range r.Endpoints {
		e := topEndpoint{Index: i, Address: fmt.Sprintf("%s:%d", ep.IP, ep.Port), Role: lbrule.RoleName(ep.Role), State: ep.State}
		if ep.Draining {
			e.State = strings.TrimPrefix(e.State+",draining", ",")
		}
		if e.State == "" {
			e.State = "-"
		}
		m := map[string]string{"service": id, "ep_idx": strconv.Itoa(i)}
		if v, ok := gauge(cur, "loxilb_endpoint_healthy", m); ok {
			h := v == 1
			e.Healthy = &h
		}
		e.ReqRate = rate("loxilb_ai_requests_total", m)
		e.Hits = rate("loxilb_pd_kv_tier15_hits_total", m)
		if v, ok := gauge(cur, "loxilb_pd_kv_blocks", m); ok {
			e.Blocks = &v
		}
		for _, x := range cur {
			if x.name == "loxilb_kv_parity_verdict" && x.value == 1 && matches(x.labels, m) {
				e.Parity = x.labels["verdict"]
			}
		}
		if v, ok := gauge(cur, "loxilb_kv_subscriber_connected", m); ok {
			e.Events = "connected"
			if v != 1 {
				e.Events = "disconnected"
			}
			if d, _ := gauge(cur, "loxilb_kv_subscriber_degraded", m); d == 1 {
				e.Events = "degraded"
			}
			if q, _ := gauge(cur, "loxilb_kv_quarantined", m); q == 1 {
				e.Events = "quarantined"
			}
		}
		e.Predicted = rate("loxilb_pd_kv_predicted_cached_tokens_total", m)
		e.Reported = rate("loxilb_pd_kv_reported_cached_tokens_total", m)
		e.Waiting, _ = gauge(cur, "loxilb_kv_prefill_queue_depth", m)
		e.Inflight, _ = gauge(cur, "loxilb_pd_inflight", m)
		s.Endpoints = append(s.Endpoints, e)
	}
	return s
}

func printTopFrame(g *globalOpts, f topFrame) {
	g.printf("loxicmd top  %s  rates over %.1fs\n", f.Time.Format(time.RFC3339), f.Interval)
	if len(f.Services) == 0 {
		g.printf("\nno rules\n")
	}
	for _, s := range f.Services {
		name := s.Name
		if name == "" {
			name = "-"
		}
		g.printf("\nservice %d %s  %s:%d/%s  %s\n", s.ID, name, s.VIP, s.Port, s.Protocol, s.Mode)
		p95 := "-"
		if s.P95 != nil {
			p95 = fmtDur(*s.P95)
		}
		g.printf("  requests %s/s  2xx %s  4xx %s  5xx %s  p95 %s\n", fmtRate(s.ReqRate), fmtRate(s.Status.S2xx),
			fmtRate(s.Status.S4xx), fmtRate(s.Status.S5xx), p95)
		if s.hasKV {
			g.printf("  kv routing/s  hits %s  spills %s  cold seeds %s  misses %s  coalesced %s\n", fmtRate(s.Hits),
				fmtRate(s.Spills), fmtRate(s.ColdSeeds), fmtRate(s.Misses), fmtRate(s.Coalesced))
		}
		if s.isD {
			g.printf("  p/d  requests %s/s  shed %s/s\n", fmtRate(s.PDRate), fmtRate(s.PDShed))
		}
		if s.DPPackets != nil {
			g.printf("  data plane  %s packets/s  %s new flows/s\n", fmtRate(*s.DPPackets), fmtRate(*s.DPFlows))
		}
		w := tabwriter.NewWriter(g.out, 0, 2, 2, ' ', 0)
		fmt.Fprintln(w, "  EP\tENDPOINT\tROLE\tSTATE\tREQ/S\tHIT/S\tBLOCKS\tPARITY\tEVENTS\tKV SERVED\tWAITING\tINFLIGHT")
		for _, e := range s.Endpoints {
			state := e.State
			if e.Healthy != nil && !*e.Healthy {
				state = "down"
				if strings.HasSuffix(e.State, "draining") {
					state = "down,draining"
				}
			}
			blocks := "-"
			if e.Blocks != nil {
				blocks = strconv.FormatFloat(*e.Blocks, 'f', 0, 64)
			}
			served := "-" // engine-reported over predicted cached tokens
			if e.Predicted > 0 {
				served = fmt.Sprintf("%.0f%%", 100*e.Reported/e.Predicted)
			}
			fmt.Fprintf(w, "  %d\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%.0f\t%.0f\n", e.Index, e.Address, e.Role, state,
				fmtRate(e.ReqRate), fmtRate(e.Hits), blocks, dash(e.Parity), dash(e.Events), served, e.Waiting, e.Inflight)
		}
		w.Flush()
	}
}

func fmtRate(v float64) string { return strconv.FormatFloat(v, 'f', 1, 64) }

func fmtDur(s float64) string {
	if math.IsInf(s, 1) {
		return "> last bucket"
	}
	return time.Duration(s * float64(time.Second)).Round(time.Microsecond * 100).String()
}

// promSeries is one sample of the text exposition.
type promSeries struct {
	name   string
	labels map[string]string
	value  float64
}

// parseExposition reads the Prometheus text format (what GET /metrics
// serves): comments and blank lines are skipped, a malformed line is an
// error naming its number.
func parseExposition(text string) ([]promSeries, error) {
	var out []promSeries
	for n, line := range strings.Split(text, "\n") {
		line = strings.TrimSpace(line)
		if line == "" || line[0] == '#' {
			continue
		}
		s, err := parseSample(line)
		if err != nil {
			return nil, fmt.Errorf("line %d: %w", n+1, err)
		}
		out = append(out, s)
	}
	return out, nil
}

func parseSample(line string) (promSeries, error) {
	s := promSeries{labels: map[string]string{}}
	i := strings.IndexAny(line, "{ ")
	if i <= 0 {
		return s, fmt.Errorf("no value in %q", line)
	}
	s.name, line = line[:i], line[i:]
	if line[0] == '{' {
		line = line[1:]
		for {
			line = strings.TrimLeft(line, ", ")
			if line == "" {
				return s, fmt.Errorf("unterminated labels of %s", s.name)
			}
			if line[0] == '}' {
				line = line[1:]
				break
			}
			eq := strings.Index(line, `="`)
			if eq <= 0 {
				return s, fmt.Errorf("bad label in %s", s.name)
			}
			key := line[:eq]
			line = line[eq+2:]
			var b strings.Builder
			j := 0
			for ; j < len(line) && line[j] != '"'; j++ {
				if line[j] == '\\' && j+1 < len(line) {
					j++
					switch line[j] {
					case 'n':
						b.WriteByte('\n')
					default:
						b.WriteByte(line[j])
					}
					continue
				}
				b.WriteByte(line[j])
			}
			if j == len(line) {
				return s, fmt.Errorf("unterminated label value of %s", s.name)
			}
			s.labels[key] = b.String()
			line = line[j+1:]
		}
	}
	f := strings.Fields(line)
	if len(f) == 0 {
		return s, fmt.Errorf("no value for %s", s.name)
	}
	v, err := strconv.ParseFloat(f[0], 64)
	if err != nil {
		return s, fmt.Errorf("value of %s: %w", s.name, err)
	}
	s.value = v
	return s, nil
}

func matches(labels, m map[string]string) bool {
	for k, v := range m {
		if labels[k] != v {
			return false
		}
	}
	return true
}

func has(ss []promSeries, name string, m map[string]string) bool {
	for _, s := range ss {
		if s.name == name && matches(s.labels, m) {
			return true
		}
	}
	return false
}

func sumOf(ss []promSeries, name string, m map[string]string) float64 {
	var v float64
	for _, s := range ss {
		if s.name == name && matches(s.labels, m) {
			v += s.value
		}
	}
	return v
}

func gauge(ss []promSeries, name string, m map[string]string) (float64, bool) {
	return sumOf(ss, name, m), has(ss, name, m)
}

// counterRate is the per-second increase of the matching series; a series
// that went down (daemon restart) counts from zero.
func counterRate(prev, cur []promSeries, name string, m map[string]string, dt float64) float64 {
	if dt <= 0 {
		return 0
	}
	d := sumOf(cur, name, m) - sumOf(prev, name, m)
	if d < 0 {
		d = sumOf(cur, name, m)
	}
	return d / dt
}

// histogramQuantile estimates quantile q of the observations made between
// two readings of histogram name, interpolating linearly inside a bucket
// as Prometheus' histogram_quantile does. ok is false when nothing was
// observed.
func histogramQuantile(q float64, prev, cur []promSeries, name string, m map[string]string) (float64, bool) {
	type bucket struct{ le, n float64 }
	counts := map[float64]float64{}
	for _, pass := range []struct {
		ss   []promSeries
		sign float64
	}{{cur, 1}, {prev, -1}} {
		for _, s := range pass.ss {
			if s.name != name+"_bucket" || !matches(s.labels, m) {
				continue
			}
			le, err := strconv.ParseFloat(s.labels["le"], 64)
			if err != nil {
				continue
			}
			counts[le] += pass.sign * s.value
		}
	}
	var bs []bucket
	for le, n := range counts {
		bs = append(bs, bucket{le, n})
	}
	sort.Slice(bs, func(i, j int) bool { return bs[i].le < bs[j].le })
	if len(bs) == 0 || bs[len(bs)-1].n <= 0 {
		return 0, false
	}
	rank := q * bs[len(bs)-1].n
	lower, below := 0.0, 0.0
	for _, b := range bs {
		if b.n >= rank {
			if math.IsInf(b.le, 1) {
				return lower, true
			}
			if b.n == below {
				return b.le, true
			}
			return lower + (b.le-lower)*(rank-below)/(b.n-below), true
		}
		lower, below = b.le, b.n
	}
	return lower, true
}
