package main

import (
	"context"
	"fmt"
	"net/netip"
	"strconv"
	"strings"
	"time"

	"github.com/spf13/cobra"

	"github.com/loxilb-llm/loxilb/api"
)

// newSetDrainCmd is `loxicmd set drain on|off VIP --tcp=PORT --endpoint=IP:PORT`:
// endpoint maintenance. A draining endpoint gets no new requests (mode 4)
// or flows (L4); those in flight finish, and its KV subscription is kept
// so it returns warm.
func newSetDrainCmd(g *globalOpts) *cobra.Command {
	var tcp, udp, sctp, endpoint string
	var mark int
	var wait time.Duration
	cmd := &cobra.Command{
		Use:   "drain on|off VIP",
		Short: "Put a rule's endpoint in maintenance (on: no new requests, those in flight finish) or back in service (off)",
		Example: `  loxicmd set drain on 127.0.0.10 --tcp=2090 --endpoint=127.0.0.12:30000 --wait=2m
  loxicmd set drain off 127.0.0.10 --tcp=2090 --endpoint=127.0.0.12:30000`,
		Args: func(_ *cobra.Command, args []string) error {
			if len(args) != 2 || (args[0] != "on" && args[0] != "off") {
				return usagef("set drain takes on or off, then the rule's VIP")
			}
			return nil
		},
		RunE: func(_ *cobra.Command, args []string) error {
			on := args[0] == "on"
			proto, portS := "", ""
			for p, v := range map[string]string{"tcp": tcp, "udp": udp, "sctp": sctp} {
				if v == "" {
					continue
				}
				if proto != "" {
					return usagef("give one of --tcp, --udp or --sctp")
				}
				proto, portS = p, v
			}
			if proto == "" {
				return usagef("give the rule's service port with --tcp, --udp or --sctp")
			}
			p, _, _ := strings.Cut(portS, ":")
			port, err := strconv.Atoi(p)
			if err != nil {
				return usagef("--%s %q: want PORT", proto, portS)
			}
			ap, err := netip.ParseAddrPort(endpoint)
			if err != nil {
				return usagef("--endpoint %q: want IP:PORT ([IPv6]:PORT), the endpoint's address and target port", endpoint)
			}
			if wait < 0 || (wait > 0 && !on) {
				return usagef("--wait applies to drain on and takes a positive duration")
			}
			c, err := g.client()
			if err != nil {
				return err
			}
			ctx := context.Background()
			st, err := c.SetDrain(ctx, args[1], port, proto, mark, ap.Addr().String(), int(ap.Port()), on)
			if err != nil {
				return err
			}
			deadline := time.Now().Add(wait)
			for wait > 0 && st.InFlight != nil && *st.InFlight > 0 && time.Now().Before(deadline) {
				time.Sleep(min(500*time.Millisecond, time.Until(deadline)))
				if st, err = c.Drain(ctx, args[1], port, proto, mark, ap.Addr().String(), int(ap.Port())); err != nil {
					return err
				}
			}
			if g.output == "json" {
				return printJSON(g, st)
			}
			printDrain(g, st)
			if wait > 0 && st.InFlight != nil && *st.InFlight > 0 {
				return fmt.Errorf("endpoint %s still has %d requests in flight after --wait %v", st.Endpoint, *st.InFlight, wait)
			}
			return nil
		},
	}
	f := cmd.Flags()
	f.StringVar(&tcp, "tcp", "", "the rule's service PORT (PORT:TARGET accepted)")
	f.StringVar(&udp, "udp", "", "the rule's service PORT")
	f.StringVar(&sctp, "sctp", "", "the rule's service PORT")
	f.StringVar(&endpoint, "endpoint", "", "the endpoint as IP:PORT (its target port)")
	f.IntVar(&mark, "mark", 0, "the rule's mark (block)")
	f.DurationVar(&wait, "wait", 0, "with on: wait up to this long for the endpoint's requests in flight (mode 4) to finish")
	return cmd
}

func printDrain(g *globalOpts, st api.EndpointDrain) {
	state := "in service"
	if st.Draining {
		state = "draining"
	}
	g.printf("service %d endpoint %d (%s): %s", st.ServiceID, st.EPIdx, st.Endpoint, state)
	if !st.Changed {
		g.printf(" (unchanged)")
	}
	if st.InFlight != nil {
		g.printf(", %d requests in flight", *st.InFlight)
	}
	g.printf("\n")
}
