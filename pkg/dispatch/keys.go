package dispatch

import (
	"encoding/json"

	"github.com/zeebo/xxh3"
)

// PromptKeys hashes the prompt text of an OpenAI-style body ("prompt",
// "messages", or SGLang's "text"/"input_ids") in chunk-byte pieces, each
// key chained over all bytes before it, so equal keys mean an equal prompt
// prefix. It is the prefix-history key when no engine block keys are known
// (base P/D): approximate, because byte chunks are not token blocks, but
// stable for a client that repeats a prefix. nil when there is no prompt.
func PromptKeys(body []byte, chunk int) []uint64 {
	var m map[string]json.RawMessage
	if json.Unmarshal(body, &m) != nil {
		return nil
	}
	return promptKeys(m, chunk)
}

func promptKeys(m map[string]json.RawMessage, chunk int) []uint64 {
	var text []byte
	for _, k := range []string{"messages", "prompt", "text", "input_ids"} {
		if v, ok := m[k]; ok {
			text = v
			break
		}
	}
	if len(text) < chunk || chunk <= 0 {
		return nil
	}
	n := len(text) / chunk
	out := make([]uint64, n)
	h := xxh3.New()
	for i := range n {
		_, _ = h.Write(text[i*chunk : (i+1)*chunk])
		out[i] = h.Sum64()
	}
	return out
}
