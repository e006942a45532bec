package main

import (
	"errors"
	"flag"
	"fmt"
	"io"

	"github.com/loxilb-llm/loxilb/pkg/dataplane/ebpf"
)

// cleanup is `loxilb cleanup`: it removes what a data plane left in the
// kernel once no daemon runs on the pin path, and prints every object it
// removed, or that there was nothing to remove.
func cleanup(args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("loxilb cleanup", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() {
		fmt.Fprintln(stderr, "usage: loxilb cleanup [--bpf-pin-path DIR]\n\n"+
			"Detaches and unpins everything the data plane pinned under DIR (TCX, cls_bpf and sk_lookup\n"+
			"attachments, maps) and removes the local VIP routes it added (protocol 76) in this network\n"+
			"namespace. Refused while a daemon runs on DIR.")
		fs.PrintDefaults()
	}
	pin := fs.String("bpf-pin-path", defaultPinPath, "bpffs directory the daemon pinned its maps and links in")
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return nil
		}
		return err
	}
	if fs.NArg() > 0 {
		return fmt.Errorf("cleanup: unexpected argument %q", fs.Arg(0))
	}
	rep, err := ebpf.Cleanup(*pin)
	for _, r := range rep.Removed {
		fmt.Fprintln(stdout, r)
	}
	for _, l := range rep.Left {
		fmt.Fprintln(stdout, "left", l)
	}
	if err != nil {
		return fmt.Errorf("cleanup: %w", err)
	}
	if len(rep.Removed) == 0 {
		fmt.Fprintf(stdout, "nothing to remove (pin path %s, local VIP routes of this network namespace)\n", *pin)
	} else {
		fmt.Fprintf(stdout, "removed %d objects\n", len(rep.Removed))
	}
	return nil
}
