package dispatch

import (
	"encoding/json"
	"testing"
)

// FuzzPrefillResponse feeds arbitrary prefill/context response bodies and
// client bodies to every parser and rewriter: no panic, and any params
// accepted are a JSON object pointing at the prefill endpoint.
func FuzzPrefillResponse(f *testing.F) {
	f.Add([]byte(`{"kv_transfer_params":{"do_remote_prefill":true,"remote_block_ids":[1,2],"remote_engine_id":"e"}}`))
	f.Add([]byte(`{"choices":[{"finish_reason":"length","disaggregated_params":{"ctx_request_id":3,"first_gen_tokens":[1],"encoded_opaque_state":"eA=="}}]}`))
	f.Add([]byte(`{"object":"chat.completion","choices":[{"message":{"content":"x"},"finish_reason":"stop"}]}`))
	f.Add([]byte(`{"prompt":["a","b"],"messages":[{"role":"user","content":"hello hello hello hello hello hello hello hello"}]}`))
	f.Add([]byte(`[]`))
	f.Add([]byte(`{"kv_transfer_params":null}`))
	f.Fuzz(func(t *testing.T, b []byte) {
		ep := Endpoint{Idx: 1, Host: "127.0.0.5", Port: 8000}
		if p, _, err := vllmParams(b, ep, 1<<12); err == nil {
			var m map[string]any
			if json.Unmarshal(p, &m) != nil || m["remote_host"] != "127.0.0.5" || m["remote_port"] != 8000.0 {
				t.Fatalf("accepted params %s", p)
			}
		}
		if c, err := parseTRTContext(b, 1<<12); err == nil && c.params != nil {
			var m map[string]any
			if json.Unmarshal(c.params, &m) != nil || m["request_type"] != "generation_only" {
				t.Fatalf("accepted context params %s", c.params)
			}
		}
		_, _ = completionToSSE(b)
		_ = PromptKeys(b, 8)
		if m, err := parseBody(b); err == nil {
			for _, out := range [][]byte{vllmPrefillBody(m), trtContextBody(m), sglangBody(m, "h", 1, 2)} {
				if !json.Valid(out) {
					t.Fatalf("rewrite produced invalid JSON: %s", out)
				}
			}
		}
	})
}
