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

// exitSecondSignal is the exit status when a second SIGTERM (or SIGINT)
// ends the graceful drain early.
const exitSecondSignal = 2

func main() {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	sigs := make(chan os.Signal, 2)
	signal.Notify(sigs, os.Interrupt, syscall.SIGTERM)
	go func() {
		// The first signal starts the graceful drain; the second stops
		// waiting for it.
		<-sigs
		cancel()
		s := <-sigs
		fmt.Fprintf(os.Stderr, "loxilb: second %v during the drain: exiting now, requests still in flight are cut\n", s)
		os.Exit(exitSecondSignal)
	}()
	if err := run(ctx, os.Args[1:], os.LookupEnv); err != nil {
		fmt.Fprintln(os.Stderr, "loxilb:", err)
		os.Exit(1)
	}
}
