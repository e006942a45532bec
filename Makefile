# Build, test and run the load balancer. `make help` lists the targets.
GO        ?= go
BIN       := bin
VERSION   ?= $(shell git describe --always --dirty 2>/dev/null || echo dev)
LDFLAGS   := -X main.version=$(VERSION)
STATE_DIR ?= $(CURDIR)/.state
FUZZEXECS ?= 10000x

.PHONY: help build run test test-unit test-allocs fuzz-smoke check-generated gen-docs gen-bpf regen-parity bench bench-proxy bench-ttfb bench-routing bench-soak demo fmt vet clean

help: ## list targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | sed 's/:.*## /\t/' | column -t -s "$$(printf '\t')"

build: ## build bin/loxilb, bin/loxicmd and bin/engine-sim
	$(GO) build -ldflags "$(LDFLAGS)" -o $(BIN)/loxilb ./cmd/loxilb
	$(GO) build -ldflags "$(LDFLAGS)" -o $(BIN)/loxicmd ./loxicmd
	@if [ -d testbed/cmd/engine-sim ]; then $(GO) build -o $(BIN)/engine-sim ./testbed/cmd/engine-sim; fi

run: build ## run the daemon with a local state dir and the bundled tokenizers (API on 127.0.0.1:11111)
	$(BIN)/loxilb --state-dir $(STATE_DIR) --tokenizer-dir $(CURDIR)/testdata/tokenizers --metrics $(ARGS)

test: vet test-unit test-allocs fuzz-smoke ## everything CI runs after installing dependencies

vet:
	$(GO) vet ./...

test-unit: ## unit, conformance, privileged (when root) and end-to-end tests, with the race detector
	$(GO) test -race -count=1 -timeout 25m ./...

# Allocation counts are checked without the race detector, which makes
# sync.Pool drop items at random.
test-allocs: ## allocation checks of the hot path (zero or bounded), without the race detector
	$(GO) test -count=1 -run 'Allocs' ./...

# Each fuzz target runs for a bounded number of executions; a crash fails the
# build. The budget is a count, not a duration: Go 1.26's fuzz coordinator can
# report a spurious "context deadline exceeded" when a duration budget expires
# while a starved worker is mid-call (golang/go#75804, fixed in Go 1.27), and a
# count has no deadline to race. -timeout still bounds a target that hangs.
fuzz-smoke: ## run every fuzz target for $(FUZZEXECS) executions
	@set -e; for pkg in $$($(GO) list ./...); do \
	  dir=$$($(GO) list -f '{{.Dir}}' $$pkg); \
	  for f in $$(grep -ho '^func Fuzz[A-Za-z0-9_]*' $$dir/*_test.go 2>/dev/null | sed 's/^func //'); do \
	    echo "fuzz $$pkg $$f"; \
	    $(GO) test -run '^$$' -fuzz "^$$f$$" -fuzztime $(FUZZEXECS) -fuzzminimizetime 500x -timeout 5m $$pkg >/tmp/fuzz.$$f.log 2>&1 || { cat /tmp/fuzz.$$f.log; exit 1; }; \
	  done; \
	done

check-generated: ## regenerate BPF objects and tokenizer goldens and fail if they differ from the committed ones
	sh bpf/gen.sh && git diff --exit-code -- pkg/dataplane/ebpf testbed/netns
	sh testbed/parity/regen.sh --no-bench

gen-docs: ## rewrite the README's settings tables from cmd/loxilb/settings_table.go
	$(GO) test -count=1 -run TestREADMESettings ./cmd/loxilb -update

gen-bpf: ## regenerate the bpf2go output with the pinned clang
	sh bpf/gen.sh

regen-parity: ## regenerate tokenizer goldens and compare Go and Rust tokenizer speed
	sh testbed/parity/regen.sh

bench: ## hot-path micro-benchmarks (tokenize, hash, inventory, routing, proxy) as one table
	$(GO) run ./testbed/bench/cmd/hotpath $(ARGS)

# Not part of `make test`: it needs wrk and haproxy (apt-get install wrk haproxy)
# and runs for ~3 minutes. ARGS='-compare /path/to/other/loxilb' measures a
# second daemon build in the same run; ARGS='-syscalls' adds strace counts;
# ARGS='-sse 32' streams every answer as 32 paced events (CPU per chunk).
# It ends with bench-ttfb.
bench-proxy: build ## wrk side by side: the daemon's mode-4 proxy vs HAProxy vs direct at 8, 64, 256 connections; then bench-ttfb
	$(GO) run ./testbed/bench/cmd/proxybench -bin $(BIN)/loxilb $(ARGS)
	$(GO) run ./testbed/bench/cmd/proxybench -ttfb -bin $(BIN)/loxilb $(TTFB_ARGS)

# Needs no wrk or haproxy; ~1 minute. TTFB_ARGS='-compare /path/to/other/loxilb'
# measures a second daemon build in the same run.
bench-ttfb: build ## time a KV-exact rule adds to a 2k-token chat request's first byte: the daemon's VIP vs a vLLM emulator directly
	$(GO) run ./testbed/bench/cmd/proxybench -ttfb -bin $(BIN)/loxilb $(TTFB_ARGS)

bench-routing: build ## routing-quality benchmark through the real daemon; results in testbed/bench/results
	$(GO) run ./testbed/bench/cmd/llmbench -bin $(BIN) -out testbed/bench/results $(ARGS)

# Not part of `make test`: it runs for -duration (10 minutes by default).
# ARGS='-duration 2m -huge-frame=false' runs it shorter or without an attack.
bench-soak: build ## 10-minute soak: mixed load through a VIP with a bad publisher and a bad backend; daemon RSS and goroutines before/after, results in testbed/bench/results
	$(GO) run ./testbed/bench/cmd/soak -bin $(BIN) $(ARGS)

demo: build ## four vLLM emulators + the daemon on loopback: round robin vs KV-exact side by side (no root)
	$(GO) run ./testbed/demo -bin $(BIN)

fmt:
	gofmt -w $$(git ls-files '*.go')

clean:
	rm -rf $(BIN) $(STATE_DIR)
