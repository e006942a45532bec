package enginesim

import (
	"strconv"

	"github.com/prometheus/client_golang/prometheus"
)

// registerMetrics exposes the load and cache gauges under the engine's own
// metric names, which is what gateways scrape. reg is the engine's private
// registry, as a separate engine process would have, never the host
// program's: two emulated engines in one test binary must not collide.
func (e *Engine) registerMetrics(reg prometheus.Registerer) error {
	labels := prometheus.Labels{"model_name": e.cfg.Model}
	gauge := func(name, help string, f func() float64) prometheus.Collector {
		return prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: name, Help: help, ConstLabels: labels}, f)
	}
	counter := func(name, help string, f func() float64) prometheus.Collector {
		return prometheus.NewCounterFunc(prometheus.CounterOpts{Name: name, Help: help, ConstLabels: labels}, f)
	}
	running := func() float64 { return float64(e.sched.running.Load()) }
	waiting := func() float64 { return float64(e.sched.waiting.Load()) }
	hitRate := func() float64 {
		q := e.promptTok.Load()
		if q == 0 {
			return 0
		}
		return float64(e.hitTok.Load()) / float64(q)
	}
	var cs []prometheus.Collector
	switch e.cfg.Engine {
	case EngineVLLM:
		labels["engine"] = "0"
		cs = []prometheus.Collector{
			gauge("vllm:num_requests_running", "Number of requests in model execution batches.", running),
			gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", waiting),
			gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", e.kvUsage),
			gauge("vllm:gpu_cache_usage_perc", "GPU KV-cache usage (older name). 1 means 100 percent usage.", e.kvUsage),
			counter("vllm:prefix_cache_queries_total", "Prefix cache queries, in terms of number of queried tokens.",
				func() float64 { return float64(e.promptTok.Load()) }),
			counter("vllm:prefix_cache_hits_total", "Prefix cache hits, in terms of number of cached tokens.",
				func() float64 { return float64(e.hitTok.Load()) }),
			// vLLM's info gauge carries its CacheConfig only: the sequence
			// budget (--max-num-seqs, a scheduler setting) is published
			// nowhere, so a gateway has to observe it.
			prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "vllm:cache_config_info", Help: "Information of the LLMEngine CacheConfig",
				ConstLabels: prometheus.Labels{"engine": "0", "block_size": strconv.Itoa(e.cfg.BlockSize),
					"num_gpu_blocks": strconv.Itoa(e.cfg.CapacityBlocks), "enable_prefix_caching": "True"}},
				func() float64 { return 1 }),
		}
	case EngineSGLang:
		cs = []prometheus.Collector{
			gauge("sglang:token_usage", "The token usage.", e.kvUsage),
			gauge("sglang:cache_hit_rate", "The prefix cache hit rate.", hitRate),
		}
		if len(e.ranks) == 1 {
			cs = append(cs, gauge("sglang:num_running_reqs", "The number of running requests.", running),
				gauge("sglang:num_queue_reqs", "The number of requests in the waiting queue.", waiting))
			break
		}
		// With data parallelism every rank's scheduler publishes its own
		// running and queued requests, labelled with its dp_rank (and its
		// tp_rank, pp_rank, engine_type). The emulator keeps one KV-usage
		// and hit-rate series for the engine.
		for _, r := range e.ranks {
			rl := prometheus.Labels{"model_name": e.cfg.Model, "engine_type": "unified", "tp_rank": "0", "pp_rank": "0", "dp_rank": strconv.Itoa(r.id)}
			cs = append(cs,
				prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "sglang:num_running_reqs", Help: "The number of running requests.", ConstLabels: rl},
					func() float64 { return float64(r.running.Load()) }),
				prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "sglang:num_queue_reqs", Help: "The number of requests in the waiting queue.", ConstLabels: rl},
					func() float64 { return float64(r.waiting.Load()) }))
		}
	case EngineLlamaCpp:
		cs = []prometheus.Collector{
			gauge("llamacpp:requests_processing", "Number of requests processing.", running),
			gauge("llamacpp:requests_deferred", "Number of requests deferred.", waiting),
			gauge("llamacpp:kv_cache_usage_ratio", "KV-cache usage. 1 means 100 percent usage.", e.kvUsage),
		}
	default:
		cs = []prometheus.Collector{
			gauge("trtllm:num_requests_running", "Number of running requests.", running),
			gauge("trtllm:num_requests_waiting", "Number of waiting requests.", waiting),
			gauge("trtllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", e.kvUsage),
		}
	}
	for _, c := range cs {
		if err := reg.Register(c); err != nil {
			return err
		}
	}
	return nil
}
