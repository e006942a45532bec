package main

import (
	"fmt"
	"io"
	"os"
	"strings"
	"time"

	"github.com/spf13/cobra"

	"github.com/loxilb-llm/loxilb/api/client"
)

// globalOpts are the persistent flags shared by every command.
type globalOpts struct {
	server    string
	port      int
	protocol  string
	tokenFile string
	output    string
	timeout   time.Duration
	caCert    string
	insecure  bool
	out, errw io.Writer
}

func newRootCmd(out, errw io.Writer) *cobra.Command {
	g := &globalOpts{out: out, errw: errw}
	root := &cobra.Command{
		Use:           "loxicmd",
		Short:         "Manage the LLM-aware load balancer (rules, capabilities, KV inventories, parity tools)",
		SilenceUsage:  true,
		SilenceErrors: true,
	}
	root.SetOut(out)
	root.SetErr(errw)
	root.SetFlagErrorFunc(func(_ *cobra.Command, err error) error { return usageError{err} })
	pf := root.PersistentFlags()
	pf.StringVarP(&g.server, "server", "s", "127.0.0.1", "daemon address")
	pf.IntVarP(&g.port, "port", "p", 11111, "daemon API port")
	pf.StringVar(&g.protocol, "protocol", "http", "http or https")
	pf.StringVar(&g.tokenFile, "token-file", os.Getenv("LOXICMD_TOKEN_FILE"), "file holding the API bearer token (env LOXICMD_TOKEN_FILE)")
	pf.StringVarP(&g.output, "output", "o", "table", "output format: table, wide or json")
	pf.DurationVarP(&g.timeout, "timeout", "t", 10*time.Second, "request timeout")
	pf.StringVar(&g.caCert, "cacert", "", "CA certificate (PEM) to verify an https daemon")
	pf.BoolVarP(&g.insecure, "insecure", "k", false, "skip TLS verification of the daemon (lab use only)")

	create := &cobra.Command{Use: "create", Short: "Create a resource"}
	create.AddCommand(newCreateLBCmd(g))
	get := &cobra.Command{Use: "get", Short: "Show resources"}
	get.AddCommand(newGetLBCmd(g), newGetCapabilitiesCmd(g), newGetInventoryCmd(g), newGetDiagnosticsCmd(g), newGetClusterCmd(g))
	del := &cobra.Command{Use: "delete", Short: "Delete a resource"}
	del.AddCommand(newDeleteLBCmd(g))
	set := &cobra.Command{Use: "set", Short: "Change daemon settings and endpoint maintenance"}
	set.AddCommand(newSetMetricsCmd(g), newSetDrainCmd(g))
	kv := &cobra.Command{Use: "kv", Short: "Offline KV-parity tools (no daemon needed)"}
	kv.AddCommand(newKVTokenizeCmd(g), newKVHashCmd(g))
	root.AddCommand(create, get, del, set, kv, newTopCmd(g))
	return root
}

func (g *globalOpts) client() (*client.Client, error) {
	if g.output != "table" && g.output != "wide" && g.output != "json" {
		return nil, usagef("--output %q: want table, wide or json", g.output)
	}
	token := ""
	if g.tokenFile != "" {
		b, err := os.ReadFile(g.tokenFile)
		if err != nil {
			return nil, usagef("read --token-file: %v", err)
		}
		token = strings.TrimSpace(string(b))
		if token == "" {
			return nil, usagef("--token-file %s is empty", g.tokenFile)
		}
	}
	c, err := client.New(client.Config{Server: g.server, Port: g.port, Protocol: g.protocol, Token: token,
		Timeout: g.timeout, CACert: g.caCert, Insecure: g.insecure})
	if err != nil {
		return nil, usageError{err}
	}
	return c, nil
}

func (g *globalOpts) printf(format string, args ...any) { fmt.Fprintf(g.out, format, args...) }
