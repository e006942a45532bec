package main

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"text/tabwriter"

	"github.com/spf13/cobra"

	"github.com/loxilb-llm/loxilb/pkg/cluster"
)

// errDrift: the daemon answered, and a parity-relevant setting differs
// between nodes (exit 8, as a failed diagnostics check), so a rollout can
// be gated on every node agreeing.
var errDrift = errors.New("settings differ between nodes")

func newGetClusterCmd(g *globalOpts) *cobra.Command {
	return &cobra.Command{
		Use:     "cluster",
		Aliases: []string{"nodes", "members"},
		Short:   "Gateway nodes sharing the rule store, and the parity-relevant settings that differ between them",
		Long: "Lists the nodes announced in the shared rule store (etcd; with the embedded store, this node alone):\n" +
			"name, API address, version, state, seed fingerprint and staged tokenizers.\n" +
			"Then each setting that differs (seed fingerprint, a tokenizer's checksum, a routing setting) with every node's value;\n" +
			"'*' marks the nodes away from the majority value (all of them when there is none).\n" +
			"Exits 8 when any setting differs.",
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			c, err := g.client()
			if err != nil {
				return err
			}
			v, err := c.Cluster(context.Background())
			if err != nil {
				return err
			}
			if g.output == "json" {
				if err := printJSON(g, v); err != nil {
					return err
				}
			} else {
				printCluster(g, v)
			}
			if v.Drifted {
				return fmt.Errorf("%w (%d setting(s))", errDrift, len(v.Drift))
			}
			return nil
		},
	}
}

func printCluster(g *globalOpts, v cluster.View) {
	w := tabwriter.NewWriter(g.out, 0, 2, 2, ' ', 0)
	fmt.Fprintln(w, "NODE\tADDRESS\tVERSION\tSTATE\tSEED\tTOKENIZERS\tSTARTED")
	for _, n := range v.Nodes {
		name := n.Name
		if n.Self {
			name += " (this)"
		}
		toks := 0
		for k := range n.Settings {
			if strings.HasPrefix(k, cluster.TokenizerPrefix) {
				toks++
			}
		}
		fmt.Fprintf(w, "%s\t%s\t%s\t%s\t%s\t%d\t%s\n", name, dash(n.Address), dash(n.Version), n.State,
			cluster.Shown(n.Settings[cluster.SettingSeed]), toks, n.Started.UTC().Format("2006-01-02T15:04:05Z"))
	}
	w.Flush()
	ttl := ""
	if v.TTLSeconds > 0 {
		ttl = fmt.Sprintf(", lease ttl %ds", v.TTLSeconds)
	}
	g.printf("%d node(s), store %s%s\n", len(v.Nodes), v.Backend, ttl)
	if v.Reason != "" {
		g.printf("note: %s\n", v.Reason)
	}
	for _, inv := range v.Invalid {
		g.printf("unreadable member record: %s\n", inv)
	}
	if len(v.Drift) == 0 {
		g.printf("no drift: every node has the same seed fingerprint, tokenizers and routing settings\n")
		return
	}
	g.printf("\n")
	w = tabwriter.NewWriter(g.out, 0, 2, 2, ' ', 0)
	fmt.Fprintln(w, "DRIFT\tNODE\tVALUE\t")
	for _, d := range v.Drift {
		drifting := map[string]bool{}
		for _, n := range d.Drifting {
			drifting[n] = true
		}
		setting := d.Setting
		for _, nv := range d.Values {
			mark := ""
			if drifting[nv.Node] {
				mark = "*"
			}
			fmt.Fprintf(w, "%s\t%s\t%s\t%s\n", setting, nv.Node, cluster.Shown(nv.Value), mark)
			setting = ""
		}
	}
	w.Flush()
}
