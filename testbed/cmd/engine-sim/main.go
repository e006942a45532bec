// Command engine-sim runs one emulated inference engine (vLLM, SGLang,
// TensorRT-LLM or llama.cpp) with the engine's HTTP API, a real prefix cache
// and KV events in the engine's wire format. See testbed/enginesim/README.md.
//
// When it is ready it prints one JSON line to stdout naming its addresses:
//
//	{"ready":true,"http":"127.0.0.1:8000","zmq_ports":[5557],"replay_ports":[6557],"bootstrap_port":0}
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"github.com/loxilb-llm/loxilb/testbed/enginesim"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, os.Args[1:], os.Stdout, os.Stderr); err != nil {
		fmt.Fprintln(os.Stderr, "engine-sim:", err)
		os.Exit(1)
	}
}

// Ready is the line printed once every socket is bound.
type Ready struct {
	Ready         bool   `json:"ready"`
	Engine        string `json:"engine"`
	Role          string `json:"role"`
	HTTP          string `json:"http"`
	ZMQPorts      []int  `json:"zmq_ports"`
	ReplayPorts   []int  `json:"replay_ports"`
	BootstrapPort int    `json:"bootstrap_port"`
	NIXLSidePort  int    `json:"nixl_side_port,omitempty"`
}

func run(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("engine-sim", flag.ContinueOnError)
	fs.SetOutput(stderr)
	var c enginesim.Config
	var f enginesim.Faults
	fs.StringVar(&c.Engine, "engine", "vllm", "engine to emulate: vllm, sglang, trtllm, llamacpp")
	fs.StringVar(&c.Role, "role", "both", "P/D role: both, prefill, decode")
	fs.StringVar(&c.Listen, "listen", "127.0.0.1:8000", "HTTP listen address (port 0 picks a free port)")
	fs.StringVar(&c.AdvertiseHost, "advertise-host", "", "host named in P/D parameters (default: the listen host)")
	fs.StringVar(&c.Model, "model", "sim-model", "served model name")
	fs.IntVar(&c.MaxModelLen, "max-model-len", 32768, "maximum prompt+output tokens")
	fs.IntVar(&c.BlockSize, "block-size", 0, "tokens per KV block/page (default 16; trtllm 32)")
	fs.IntVar(&c.CapacityBlocks, "capacity-blocks", 4096, "KV pool size in blocks, per DP rank")
	fs.IntVar(&c.CPUOffloadBlocks, "cpu-offload-blocks", 0, "CPU offload tier in blocks, per DP rank; evicted GPU blocks move there and are published with medium CPU (0: none)")
	fs.StringVar(&c.ZMQBind, "zmq-bind", "127.0.0.1", "host the ZMQ PUB/ROUTER sockets bind")
	fs.IntVar(&c.ZMQPort, "zmq-port", 5557, "ZMQ PUB port of rank 0 (rank r: +r); 0 picks free ports, -1 disables")
	fs.IntVar(&c.ReplayPort, "replay-port", 0, "ZMQ replay ROUTER port of rank 0; 0 means zmq-port+1000, -1 disables")
	fs.IntVar(&c.DPRanks, "dp-ranks", 1, "data-parallel ranks (each its own cache and publisher)")
	fs.StringVar(&c.Topic, "topic", "", "ZMQ topic frame")
	fs.IntVar(&c.BufferSteps, "buffer-steps", 10000, "replay buffer size in batches")
	fs.StringVar(&c.ReplayFormat, "replay-format", "", "replay reply shape: topic (vLLM) or legacy (SGLang); default per engine")
	fs.StringVar(&c.HashAlgo, "hash-algo", "", "sha256_cbor | xxhash_cbor (vllm), sha256_sglang, blockhash_trtllm; default per engine")
	fs.StringVar(&c.Seed, "seed", os.Getenv("PYTHONHASHSEED"), "vLLM NONE_HASH seed (PYTHONHASHSEED); empty: vllm-none-hash / random for xxhash")
	fs.BoolVar(&c.BytesBlockHashes, "bytes-block-hashes", false, "vLLM: publish raw digests instead of u64 keys")
	fs.BoolVar(&c.SGLangPartialPages, "sglang-partial-pages", false, "SGLang: also cache and publish a prompt's trailing partial page")
	fs.StringVar(&c.EventEncoding, "event-encoding", "", "inner event encoding: map or array (default map for vllm, array for sglang)")
	fs.Float64Var(&c.PrefillUsPerToken, "prefill-us-per-token", 50, "prefill cost per uncached prompt token, microseconds")
	fs.Float64Var(&c.DecodeUsPerToken, "decode-us-per-token", 20000, "decode cost per output token, microseconds")
	fs.Float64Var(&c.DecodeUsPerActiveBlock, "decode-us-per-active-block", 0, "extra decode cost per step for each KV block pinned by running requests, microseconds")
	fs.IntVar(&c.MaxRunning, "max-running", 32, "concurrent sequences")
	fs.IntVar(&c.MaxQueue, "max-queue", 0, "waiting requests before 503 (0: unbounded)")
	fs.Float64Var(&c.TimeScale, "time-scale", 1, "multiplier of every modelled delay (0: no delays)")
	fs.IntVar(&c.BootstrapPort, "bootstrap-port", 8998, "SGLang prefill bootstrap port (0 picks a free port)")
	fs.IntVar(&c.NIXLSidePort, "nixl-side-port", 0, "vLLM prefill: NIXL side-channel port transfers are claimed on and remote_port names, like VLLM_NIXL_SIDE_CHANNEL_PORT (0: the HTTP port, -1: a free port)")
	fs.DurationVar(&c.PDTimeout, "pd-timeout", 30*time.Second, "how long a decode leg waits for its prefill")
	fs.IntVar(&c.TRTEventBuffer, "trt-event-buffer", 10000, "TensorRT-LLM event buffer size")
	fs.Uint64Var(&c.RandSeed, "rand-seed", 1, "seed of fault probabilities")
	loras := fs.String("lora-modules", "", "comma-separated LoRA adapter names served besides --model (vLLM)")
	tokDir := fs.String("tokenizer-dir", "", "directory with tokenizer.json (+ tokenizer_config.json); empty: built-in simple tokenizer")
	logLevel := fs.String("log-level", "info", "debug, info, warn, error")
	fs.Float64Var(&f.DropProb, "fault-drop-prob", 0, "drop each event batch with this probability")
	fs.IntVar(&f.DropBatches, "fault-drop-batches", 0, "drop the next N event batches")
	fs.IntVar(&f.ReorderBatches, "fault-reorder-batches", 0, "swap each of the next N batches with its successor")
	fs.IntVar(&f.ReorderHoldMs, "fault-reorder-hold-ms", 0, "longest wait of a held batch for its successor (default 200)")
	fs.IntVar(&f.EventDelayMs, "fault-event-delay-ms", 0, "delay every event batch")
	fs.IntVar(&f.StallMs, "fault-stall-ms", 0, "hold every request this long")
	fs.IntVar(&f.FailRequests, "fault-fail-requests", 0, "fail the next N requests (-1: all)")
	fs.IntVar(&f.FailStatus, "fault-fail-status", 500, "status of failed requests")
	fs.IntVar(&f.CloseMidStream, "fault-close-mid-stream", 0, "cut the next N responses halfway")
	fs.IntVar(&f.ResetRequests, "fault-reset-requests", 0, "read the next N requests whole, then reset the connection without answering (-1: all)")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		return fmt.Errorf("unexpected arguments %q", fs.Args())
	}
	c.TimeScaleSet = true
	c.Faults = f
	if *loras != "" {
		c.LoRAModules = strings.Split(*loras, ",")
	}

	var level slog.Level
	if err := level.UnmarshalText([]byte(*logLevel)); err != nil {
		return fmt.Errorf("log level %q: %w", *logLevel, err)
	}
	log := slog.New(slog.NewTextHandler(stderr, &slog.HandlerOptions{Level: level}))
	deps := enginesim.Deps{Logger: log}
	if *tokDir != "" {
		tok, err := enginesim.LoadTokenizer(*tokDir)
		if err != nil {
			return err
		}
		deps.Tokenizer = tok
	}
	if c.Engine != enginesim.EngineVLLM && c.Engine != enginesim.EngineSGLang {
		c.ZMQPort = -1
	}
	e, err := enginesim.New(c, deps)
	if err != nil {
		return err
	}
	ready := Ready{Ready: true, Engine: e.Config().Engine, Role: e.Config().Role, HTTP: e.Addr(),
		ZMQPorts: e.ZMQPorts(), ReplayPorts: e.ReplayPorts(), BootstrapPort: e.BootstrapPort(), NIXLSidePort: e.NIXLSidePort()}
	if ready.ZMQPorts == nil {
		ready.ZMQPorts = []int{}
	}
	if ready.ReplayPorts == nil {
		ready.ReplayPorts = []int{}
	}
	line, _ := json.Marshal(ready)
	fmt.Fprintf(stdout, "%s\n", line)
	log.Info("engine ready", "http", ready.HTTP, "zmq", ready.ZMQPorts, "replay", ready.ReplayPorts)
	return e.Run(ctx)
}
