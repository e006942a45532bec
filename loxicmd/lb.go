package main

import (
	"context"
	"encoding/json"
	"fmt"
	"net"
	"net/netip"
	"strconv"
	"strings"
	"text/tabwriter"

	"github.com/spf13/cobra"

	"github.com/loxilb-llm/loxilb/api"
	"github.com/loxilb-llm/loxilb/pkg/lbrule"
)

type createLBOpts struct {
	tcp, udp, sctp []string
	endpoints      string
	mode, sel      string
	security       string
	name           string
	mark           int
	monitor        bool
	inaTimeout     int
	probeType      string
	probePort      int
	probeReq       string
	probeResp      string
	probeTimeout   int
	probeRetries   int
	modelName      string
	sessionHeader  string
	pdDisagg       bool
	epRoles        string
	nixlPorts      string
	kvExactMode    int
	kvEngine       string
	kvRanks        int
	kvZmqPort      int
	kvHashAlgo     string
	kvBlockSize    int
	kvWarmup       int
	kvParityStrict bool
	pdBootstrap    int
	dryRun         bool
}

func newCreateLBCmd(g *globalOpts) *cobra.Command {
	o := &createLBOpts{}
	cmd := &cobra.Command{
		Use:   "lb VIP",
		Short: "Create (or update) a load-balancer rule",
		Example: `  loxicmd create lb 192.0.2.10 --tcp=2090:30000 --endpoints=198.51.100.11:1,198.51.100.12:1 \
    --mode=fullproxy --select=chwbl --kv-exact-mode=3 --kv-engine-type=sglang --kv-dp-ranks=1 \
    --kv-zmq-port=5557 --kv-block-size=16 --kv-warmup=30`,
		Args: func(_ *cobra.Command, args []string) error {
			if len(args) != 1 {
				return usagef("create lb takes exactly one VIP argument")
			}
			return nil
		},
		RunE: func(cmd *cobra.Command, args []string) error {
			rules, err := o.build(cmd, args[0])
			if err != nil {
				return err
			}
			if o.dryRun {
				return printJSON(g, rules)
			}
			c, err := g.client()
			if err != nil {
				return err
			}
			for _, r := range rules {
				res, err := c.CreateLB(context.Background(), r)
				if err != nil {
					return err
				}
				if g.output == "json" {
					if err := printJSON(g, res); err != nil {
						return err
					}
					continue
				}
				verb := "updated"
				if res.Created != nil && *res.Created {
					verb = "created"
				}
				g.printf("%s rule %s:%d/%s (service id %d)\n", verb, r.Service.ExternalIP, r.Service.Port, r.Service.Protocol, res.ServiceID)
				for _, f := range res.Inert {
					g.printf("  inert: %s: %s\n", f.Field, f.Reason)
				}
			}
			return nil
		},
	}
	f := cmd.Flags()
	f.StringSliceVar(&o.tcp, "tcp", nil, "PORT:TARGETPORT (repeatable, comma-separated)")
	f.StringSliceVar(&o.udp, "udp", nil, "PORT:TARGETPORT")
	f.StringSliceVar(&o.sctp, "sctp", nil, "PORT:TARGETPORT")
	f.StringVar(&o.endpoints, "endpoints", "", "IP:WEIGHT,... (weight split at the last ':' so IPv6 works)")
	f.StringVar(&o.mode, "mode", "default", "default, onearm, fullnat, dsr, fullproxy or hostonearm")
	f.StringVar(&o.sel, "select", "rr", "rr, hash, priority, persist, lc, n2, n3, chwbl, gpuaware or wrr-hash")
	f.StringVar(&o.security, "security", "", "TLS level for fullproxy: https|tls (terminate) or e2ehttps|e2etls")
	f.StringVar(&o.name, "name", "", "rule name")
	f.IntVar(&o.mark, "mark", 0, "mark separating rules on the same VIP:port")
	f.BoolVar(&o.monitor, "monitor", false, "health-check endpoints")
	f.IntVar(&o.inaTimeout, "inatimeout", 0, "connection inactivity timeout in seconds")
	f.StringVar(&o.probeType, "probetype", "", "tcp, udp, sctp, http, https, ping or none")
	f.IntVar(&o.probePort, "probeport", 0, "probe port (0 = endpoint port)")
	f.StringVar(&o.probeReq, "probereq", "", "probe request (HTTP path)")
	f.StringVar(&o.probeResp, "proberesp", "", "expected probe response")
	f.IntVar(&o.probeTimeout, "probetimeout", 0, "seconds between probes")
	f.IntVar(&o.probeRetries, "proberetries", 0, "failures before an endpoint is down")
	f.StringVar(&o.modelName, "model-name", "", "served model of a fullproxy rule")
	f.StringVar(&o.sessionHeader, "session-header-name", "", "header carrying a session id (P/D affinity)")
	f.BoolVar(&o.pdDisagg, "pd-disagg", false, "prefill/decode disaggregation")
	f.StringVar(&o.epRoles, "ep-role", "", "normal|prefill|decode,... one per endpoint")
	f.StringVar(&o.nixlPorts, "nixl-port", "", "PORT,... one per endpoint (0 = target port)")
	f.IntVar(&o.kvExactMode, "kv-exact-mode", 0, "0 off, 1 P/D prefill pool, 3 single pool")
	f.StringVar(&o.kvEngine, "kv-engine-type", "", "vllm, sglang, trtllm or llamacpp")
	f.IntVar(&o.kvRanks, "kv-dp-ranks", 0, "SGLang data-parallel ranks (1..8)")
	f.IntVar(&o.kvZmqPort, "kv-zmq-port", 0, "base ZMQ port of KV events")
	f.StringVar(&o.kvHashAlgo, "kv-hash-algo", "", "sha256_cbor, xxhash_cbor, sha256_sglang or blockhash_trtllm (omit for the engine default)")
	f.IntVar(&o.kvBlockSize, "kv-block-size", 0, "tokens per hashed block")
	f.IntVar(&o.kvWarmup, "kv-warmup", 0, "warmup seconds (accepted, inert)")
	f.BoolVar(&o.kvParityStrict, "kv-parity-strict", false, "strict attestation: no Tier-1.5 traffic to endpoints whose parity verdict is a mismatch (omit for the daemon's --kv-parity-strict)")
	f.IntVar(&o.pdBootstrap, "pd-bootstrap-port", 0, "SGLang P/D bootstrap port (0 = 8998)")
	f.BoolVar(&o.dryRun, "dry-run", false, "print the request body instead of sending it")
	return cmd
}

// build turns the flags into one rule per protocol port pair. Only flags the
// user set are sent, so the daemon applies its own documented defaults.
func (o *createLBOpts) build(cmd *cobra.Command, vip string) ([]*lbrule.Rule, error) {
	changed := cmd.Flags().Changed
	mode, err := lbrule.ParseMode(o.mode)
	if err != nil {
		return nil, usageError{err}
	}
	sel, err := lbrule.ParseSel(o.sel)
	if err != nil {
		return nil, usageError{err}
	}
	sec := 0
	switch strings.ToLower(o.security) {
	case "", "plain", "0":
	case "https", "tls", "1":
		sec = 1
	case "e2ehttps", "e2etls", "2":
		sec = 2
	default:
		return nil, usagef("--security %q: want https, tls, e2ehttps or e2etls", o.security)
	}
	eps, err := parseEndpoints(o.endpoints)
	if err != nil {
		return nil, err
	}
	if o.epRoles != "" {
		roles := strings.Split(o.epRoles, ",")
		if len(roles) != len(eps) {
			return nil, usagef("--ep-role has %d entries but --endpoints has %d: give one role per endpoint", len(roles), len(eps))
		}
		for i, s := range roles {
			if eps[i].Role, err = lbrule.ParseRole(s); err != nil {
				return nil, usageError{err}
			}
		}
	}
	if o.nixlPorts != "" {
		ports := strings.Split(o.nixlPorts, ",")
		if len(ports) != len(eps) {
			return nil, usagef("--nixl-port has %d entries but --endpoints has %d", len(ports), len(eps))
		}
		for i, s := range ports {
			if eps[i].NixlPort, err = strconv.Atoi(strings.TrimSpace(s)); err != nil {
				return nil, usagef("--nixl-port %q is not a number", s)
			}
		}
	}
	type pp struct {
		proto       string
		port, tport int
	}
	var pairs []pp
	for proto, list := range map[string][]string{"tcp": o.tcp, "udp": o.udp, "sctp": o.sctp} {
		for _, item := range list {
			a, b, ok := strings.Cut(item, ":")
			port, err1 := strconv.Atoi(a)
			tport, err2 := strconv.Atoi(b)
			if !ok || err1 != nil || err2 != nil {
				return nil, usagef("--%s %q: want PORT:TARGETPORT", proto, item)
			}
			pairs = append(pairs, pp{proto, port, tport})
		}
	}
	if len(pairs) == 0 {
		return nil, usagef("give at least one of --tcp, --udp or --sctp as PORT:TARGETPORT")
	}
	var out []*lbrule.Rule
	for _, p := range pairs {
		s := lbrule.ServiceArgs{ExternalIP: vip, Port: p.port, Protocol: p.proto, Mode: mode, Sel: sel, Security: sec,
			Name: o.name, Block: o.mark, Monitor: o.monitor, InactiveTimeOut: o.inaTimeout,
			ProbeType: o.probeType, ProbePort: o.probePort, ProbeReq: o.probeReq, ProbeResp: o.probeResp,
			ProbeTimeout: o.probeTimeout, ProbeRetries: o.probeRetries, ModelName: o.modelName, SessionHeaderName: o.sessionHeader,
			PDDisagg: o.pdDisagg, KVExactMode: o.kvExactMode, KVEngine: o.kvEngine, KVDpRankCount: o.kvRanks,
			KVZmqPort: o.kvZmqPort, KVHashAlgo: o.kvHashAlgo, KVBlockSize: o.kvBlockSize, PDBootstrap: o.pdBootstrap}
		if changed("kv-warmup") {
			w := o.kvWarmup
			s.KVWarmupSec = &w
		}
		if changed("kv-parity-strict") {
			v := o.kvParityStrict
			s.KVParityStrict = &v
		}
		r := &lbrule.Rule{Service: s, Endpoints: append([]lbrule.Endpoint(nil), eps...)}
		for i := range r.Endpoints {
			r.Endpoints[i].Port = p.tport
		}
		out = append(out, r)
	}
	return out, nil
}

func parseEndpoints(s string) ([]lbrule.Endpoint, error) {
	if s == "" {
		return nil, usagef("--endpoints is required: IP:WEIGHT,...")
	}
	var eps []lbrule.Endpoint
	for _, item := range strings.Split(s, ",") {
		item = strings.TrimSpace(item)
		i := strings.LastIndex(item, ":")
		if i <= 0 {
			return nil, usagef("--endpoints entry %q: want IP:WEIGHT", item)
		}
		ip := strings.Trim(item[:i], "[]")
		if _, err := netip.ParseAddr(ip); err != nil {
			return nil, usagef("--endpoints entry %q: %q is not an IP address", item, ip)
		}
		w, err := strconv.Atoi(item[i+1:])
		if err != nil {
			return nil, usagef("--endpoints entry %q: weight %q is not a number", item, item[i+1:])
		}
		eps = append(eps, lbrule.Endpoint{IP: ip, Weight: w})
	}
	return eps, nil
}

func printJSON(g *globalOpts, v any) error {
	b, err := json.MarshalIndent(v, "", "  ")
	if err != nil {
		return err
	}
	g.printf("%s\n", b)
	return nil
}

func newGetLBCmd(g *globalOpts) *cobra.Command {
	var showBody bool
	cmd := &cobra.Command{
		Use:     "lb",
		Aliases: []string{"loadbalancer", "lbs"},
		Short:   "List load-balancer rules",
		Args:    cobra.NoArgs,
		RunE: func(*cobra.Command, []string) error {
			c, err := g.client()
			if err != nil {
				return err
			}
			if showBody {
				list, raw, err := c.ListLBWithBodies(context.Background())
				if err != nil {
					return err
				}
				if g.output == "json" {
					g.printf("%s\n", raw)
					return nil
				}
				printLBBodies(g, list)
				return nil
			}
			list, err := c.ListLB(context.Background())
			if err != nil {
				return err
			}
			switch g.output {
			case "json":
				return printJSON(g, list)
			case "wide":
				printLBWide(g, list)
			default:
				printLBTable(g, list)
			}
			return nil
		},
	}
	cmd.Flags().BoolVar(&showBody, "show-body", false, "print each rule's stored create body, as posted")
	return cmd
}

// printLBBodies prints, per rule, a header line and its stored create
// body as the daemon returned it, unreformatted, ready to diff or re-post.
func printLBBodies(g *globalOpts, list api.LBList) {
	for _, r := range list.LBAttr {
		s := r.Service
		name := s.Name
		if name == "" {
			name = "-"
		}
		g.printf("# service %d %s/%s %s %s\n", r.ServiceID, net.JoinHostPort(s.ExternalIP, strconv.Itoa(s.Port)), s.Protocol, name, statusCol(r.Status))
		if len(r.CreateBody) == 0 {
			g.printf("# (no stored create body)\n")
			continue
		}
		g.printf("%s\n", r.CreateBody)
	}
}

func modeCol(s lbrule.ServiceArgs) string {
	m := lbrule.ModeName(s.Mode)
	switch s.Security {
	case 1:
		m += ":https"
	case 2:
		m += ":e2ehttps"
	}
	return m
}

func kvCol(s lbrule.ServiceArgs) string {
	if s.KVExactMode == 0 && !s.PDDisagg {
		return "-"
	}
	v := fmt.Sprintf("%s/exact=%d/%s/bs=%d", s.KVEngine, s.KVExactMode, s.KVHashAlgo, s.KVBlockSize)
	if s.PDDisagg {
		v += "/pd"
	}
	if s.KVParityStrict != nil && *s.KVParityStrict {
		v += "/strict"
	}
	return v
}

func printLBTable(g *globalOpts, list api.LBList) {
	w := tabwriter.NewWriter(g.out, 0, 2, 2, ' ', 0)
	fmt.Fprintln(w, "ID\tEXT IP\tPORT\tPROTO\tNAME\tMARK\tSEL\tMODE\t# OF ENDPOINTS\tTIMEOUT\tMONITOR\tKV")
	for _, r := range list.LBAttr {
		s := r.Service
		fmt.Fprintf(w, "%d\t%s\t%d\t%s\t%s\t%d\t%s\t%s\t%d\t%d\t%v\t%s\n", r.ServiceID, s.ExternalIP, s.Port, s.Protocol, s.Name, s.Block,
			lbrule.SelName(s.Sel), modeCol(s), len(r.Endpoints), s.InactiveTimeOut, s.Monitor, kvCol(s))
	}
	w.Flush()
}

// statusCol is the RULE STATUS column: the state, with the reason code
// when the rule is not applied.
func statusCol(st *lbrule.Status) string {
	switch {
	case st == nil:
		return "-"
	case st.ReasonCode == "":
		return st.State
	}
	return st.State + ":" + st.ReasonCode
}

func printLBWide(g *globalOpts, list api.LBList) {
	w := tabwriter.NewWriter(g.out, 0, 2, 2, ' ', 0)
	fmt.Fprintln(w, "ID\tEXT IP\tPORT\tPROTO\tNAME\tSEL\tMODE\tRULE STATUS\tEP IDX\tENDPOINT\tEPORT\tWEIGHT\tROLE\tSTATE\tKV PARITY")
	for _, r := range list.LBAttr {
		s := r.Service
		for i, ep := range r.Endpoints {
			st := ep.State
			if ep.Draining {
				// In maintenance: what the probe says still shows.
				st = strings.TrimPrefix(st+",draining", ",")
			}
			if st == "" {
				st = "-"
			}
			kv := dash(ep.KVParity)
			if ep.KVExcluded {
				// Strict attestation keeps Tier-1.5 traffic off it.
				kv += ":no-tier1.5"
			}
			fmt.Fprintf(w, "%d\t%s\t%d\t%s\t%s\t%s\t%s\t%s\t%d\t%s\t%d\t%d\t%s\t%s\t%s\n", r.ServiceID, s.ExternalIP, s.Port, s.Protocol, s.Name,
				lbrule.SelName(s.Sel), modeCol(s), statusCol(r.Status), i, ep.IP, ep.Port, ep.Weight, lbrule.RoleName(ep.Role), st, kv)
		}
	}
	w.Flush()
}

func newDeleteLBCmd(g *globalOpts) *cobra.Command {
	var tcp, udp, sctp []string
	var name string
	cmd := &cobra.Command{
		Use:   "lb [VIP]",
		Short: "Delete a rule by VIP and --tcp/--udp/--sctp=PORT, or every rule with --name",
		RunE: func(_ *cobra.Command, args []string) error {
			if name == "" && len(args) != 1 {
				return usagef("give a VIP with --tcp/--udp/--sctp=PORT, or --name")
			}
			c, err := g.client()
			if err != nil {
				return err
			}
			ctx := context.Background()
			if name != "" {
				res, err := c.DeleteLBByName(ctx, name)
				if err != nil {
					return err
				}
				g.printf("deleted %d rule(s) named %q\n", res.Deleted, name)
				return nil
			}
			n := 0
			for proto, list := range map[string][]string{"tcp": tcp, "udp": udp, "sctp": sctp} {
				for _, item := range list {
					p, _, _ := strings.Cut(item, ":")
					port, err := strconv.Atoi(p)
					if err != nil {
						return usagef("--%s %q: want PORT", proto, item)
					}
					if err := c.DeleteLB(ctx, args[0], port, proto); err != nil {
						return err
					}
					g.printf("deleted rule %s:%d/%s\n", args[0], port, proto)
					n++
				}
			}
			if n == 0 {
				return usagef("give --tcp, --udp or --sctp with the service port")
			}
			return nil
		},
	}
	cmd.Flags().StringSliceVar(&tcp, "tcp", nil, "service PORT (PORT:TARGET accepted)")
	cmd.Flags().StringSliceVar(&udp, "udp", nil, "service PORT")
	cmd.Flags().StringSliceVar(&sctp, "sctp", nil, "service PORT")
	cmd.Flags().StringVar(&name, "name", "", "delete every rule with this name")
	return cmd
}

func newGetCapabilitiesCmd(g *globalOpts) *cobra.Command {
	return &cobra.Command{
		Use:     "capabilities",
		Aliases: []string{"caps"},
		Short:   "Show the readiness of gated features (kv_exact_vllm, ebpf_dataplane, tokenizers, parity)",
		Args:    cobra.NoArgs,
		RunE: func(*cobra.Command, []string) error {
			c, err := g.client()
			if err != nil {
				return err
			}
			caps, err := c.Capabilities(context.Background())
			if err != nil {
				return err
			}
			if g.output == "json" {
				return printJSON(g, caps)
			}
			w := tabwriter.NewWriter(g.out, 0, 2, 2, ' ', 0)
			fmt.Fprintln(w, "NAME\tREADY\tREASON CODE\tREASON")
			for _, c := range caps.Capabilities {
				fmt.Fprintf(w, "%s\t%v\t%s\t%s\n", c.Name, c.Ready, dash(c.ReasonCode), dash(c.Reason))
			}
			w.Flush()
			return nil
		},
	}
}

func dash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}

func newGetInventoryCmd(g *globalOpts) *cobra.Command {
	var sid uint32
	var ep, limit int
	cmd := &cobra.Command{
		Use:     "kv-inventory",
		Aliases: []string{"inventory"},
		Short:   "Show one endpoint's live KV-block inventory",
		Args:    cobra.NoArgs,
		RunE: func(*cobra.Command, []string) error {
			c, err := g.client()
			if err != nil {
				return err
			}
			inv, err := c.Inventory(context.Background(), sid, ep, limit)
			if err != nil {
				return err
			}
			if g.output == "json" {
				return printJSON(g, inv)
			}
			g.printf("service %d endpoint %d (%s) hash_algo %s: %d blocks", inv.ServiceID, inv.EPIdx, inv.Endpoint, inv.HashAlgo, inv.Total)
			if inv.Truncated {
				g.printf(" (showing %d)", len(inv.Blocks))
			}
			if ps := inv.PrefillSlots; ps != nil {
				g.printf("; prefill slots %d (%s)", ps.Slots, ps.Source)
			}
			g.printf("\n")
			for _, b := range inv.Blocks {
				g.printf("%d\t%d\n", b.BlockIdx, b.Hash)
			}
			return nil
		},
	}
	cmd.Flags().Uint32Var(&sid, "service-id", 0, "service id (see get lb)")
	cmd.Flags().IntVar(&ep, "ep-idx", 0, "endpoint index within the rule")
	cmd.Flags().IntVar(&limit, "limit", 20, "blocks to list")
	return cmd
}

func newSetMetricsCmd(g *globalOpts) *cobra.Command {
	return &cobra.Command{
		Use:   "metrics on|off",
		Short: "Enable or disable the Prometheus export at /netlox/v1/metrics",
		Args: func(_ *cobra.Command, args []string) error {
			if len(args) != 1 || (args[0] != "on" && args[0] != "off") {
				return usagef("set metrics takes on or off")
			}
			return nil
		},
		RunE: func(_ *cobra.Command, args []string) error {
			c, err := g.client()
			if err != nil {
				return err
			}
			if err := c.SetMetrics(context.Background(), args[0] == "on"); err != nil {
				return err
			}
			g.printf("metrics export %s\n", args[0])
			return nil
		},
	}
}
