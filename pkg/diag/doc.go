// Package diag is the read-only preflight of KV-exact rules: for every
// endpoint whose KV events the gateway consumes it checks what silently
// turns KV-exact routing into ordinary fallback selection — the event
// ports are reachable, events arrive, the hash contract attests, the
// engine's block size and the gateway seed agree with the rule, the
// served model's tokenizer is staged, TensorRT-LLM drain ownership, and
// the vLLM NIXL side channel the decode leg is pointed at.
//
// Each check is one line: a result (PASS, WARN, FAIL), the endpoint, what
// was found and, when not PASS, the fix. Probes go only to the endpoints
// the rules configure: a TCP connect to the ZMQ and replay ports and one
// GET of the engine's /metrics or /get_server_info. Nothing is changed.
package diag
