package main

import (
	"context"
	"errors"
	"fmt"
	"text/tabwriter"

	"github.com/spf13/cobra"
)

// errCheckFailed: the daemon answered, and at least one preflight check
// failed (exit 8), so a script can gate a rollout on it.
var errCheckFailed = errors.New("a diagnostics check failed")

func newGetDiagnosticsCmd(g *globalOpts) *cobra.Command {
	var service uint32
	cmd := &cobra.Command{
		Use:     "diagnostics",
		Aliases: []string{"diag", "preflight"},
		Short:   "Read-only preflight of KV-exact endpoints: event ports, events, parity, block size, seed, tokenizer, NIXL side channel",
		Long: "Asks the daemon to check, without changing anything, each endpoint whose KV events it consumes.\n" +
			"One line per check: PASS, WARN or FAIL, the endpoint, what was found and the fix.\n" +
			"Exits 8 when any check fails.",
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			c, err := g.client()
			if err != nil {
				return err
			}
			d, err := c.Diagnostics(context.Background(), service, cmd.Flags().Changed("service"))
			if err != nil {
				return err
			}
			if g.output == "json" {
				if err := printJSON(g, d); err != nil {
					return err
				}
			} else {
				w := tabwriter.NewWriter(g.out, 0, 2, 2, ' ', 0)
				fmt.Fprintln(w, "RESULT\tCHECK\tSERVICE/EP\tENDPOINT\tFOUND\tFIX")
				for _, ch := range d.Checks {
					fmt.Fprintf(w, "%s\t%s\t%d/%d\t%s\t%s\t%s\n", ch.Result, ch.Check, ch.ServiceID, ch.EPIdx, ch.Endpoint, ch.Found, dash(ch.Fix))
				}
				w.Flush()
				g.printf("%d pass, %d warn, %d fail\n", d.Pass, d.Warn, d.Fail)
			}
			if d.Failed {
				return fmt.Errorf("%w (%d of %d)", errCheckFailed, d.Fail, len(d.Checks))
			}
			return nil
		},
	}
	cmd.Flags().Uint32Var(&service, "service", 0, "check only this rule (service_id); default every KV-exact rule")
	return cmd
}
