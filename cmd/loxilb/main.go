// Command loxilb is the load-balancer daemon: flags -> config -> every
// component built with New -> Run(ctx). It holds no logic of its own; see
// ARCHITECTURE.md for the stages it wires together.
package main

import (
	"context"
	"fmt"
	"os"
	"os/signal"
	"syscall"
)

// version is set at build time with -ldflags "-X main.version=...".
var version = "dev"

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, os.Args[1:], os.LookupEnv); err != nil {
		fmt.Fprintln(os.Stderr, "loxilb:", err)
		os.Exit(1)
	}
}
