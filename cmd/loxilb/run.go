package main

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"sync"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"

	"github.com/loxilb-llm/loxilb/api"
	"github.com/loxilb-llm/loxilb/pkg/control"
	"github.com/loxilb-llm/loxilb/pkg/lbrule"
	"github.com/loxilb-llm/loxilb/pkg/store"
)

func run(ctx context.Context, args []string, env func(string) (string, bool)) error {
	cfg, err := parseFlags(args, env, os.Stderr)
	if err != nil {
		return err
	}
	if cfg.showVersion {
		fmt.Println(version)
		return nil
	}
	logger := cfg.logger(os.Stderr)
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))

	st, err := store.OpenBolt(cfg.stateDir)
	if err != nil {
		return fmt.Errorf("rule store: %w", err)
	}
	defer st.Close()

	ctl := control.New(st, lbrule.LookupEnv(env), logger)
	caps := &capabilities{env: env}

	var wg sync.WaitGroup
	defer wg.Wait()
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()

	if err := ctl.Load(ctx); err != nil {
		// Rules that no longer apply are reported, not dropped; the daemon
		// keeps serving the others and the API.
		logger.Error("some stored rules were not applied", "err", err)
	}

	srv, err := api.New(api.Config{Addr: cfg.apiAddr, Token: cfg.apiToken, TLSCert: cfg.tlsCert, TLSKey: cfg.tlsKey,
		MetricsEnabled: cfg.metrics, Version: version},
		api.Deps{Rules: ctl, Capabilities: caps.list, Gatherer: reg, Logger: logger})
	if err != nil {
		return err
	}
	ln, err := net.Listen("tcp", cfg.apiAddr)
	if err != nil {
		return fmt.Errorf("management API: %w", err)
	}
	logger.Info("loxilb started", "version", version, "api", ln.Addr().String(), "state_dir", cfg.stateDir,
		"tokenizer_dir", cfg.tokenizerDir, "rules", len(ctl.List()), "auth", cfg.apiToken != "", "tls", cfg.tlsCert != "")
	err = srv.Serve(ctx, ln)
	cancel()
	if err != nil && !errors.Is(err, context.Canceled) {
		return err
	}
	logger.Info("loxilb stopped")
	return nil
}

// capabilities assembles GET /status/capabilities from every stage.
type capabilities struct {
	env     func(string) (string, bool)
	mu      sync.Mutex
	sources []func() []api.Capability
}

func (c *capabilities) add(f func() []api.Capability) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.sources = append(c.sources, f)
}

func (c *capabilities) list() []api.Capability {
	vllm := api.Capability{Name: "kv_exact_vllm", Ready: true}
	if e := lbrule.SeedPrecondition(c.env); e != nil {
		vllm.Ready, vllm.ReasonCode, vllm.Reason = false, e.Reason, e.Msg
	}
	out := []api.Capability{vllm}
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, f := range c.sources {
		out = append(out, f()...)
	}
	return out
}
