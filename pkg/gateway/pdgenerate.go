package gateway

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"slices"

	"github.com/loxilb-llm/loxilb/pkg/engine"
	"github.com/loxilb-llm/loxilb/pkg/proxy"
	"github.com/loxilb-llm/loxilb/pkg/router"
)

// pdInference reports whether a request to a P/D rule runs the P/D flow:
// a POST to one of the paths the engine's capability row lists (the
// OpenAI generation paths, and SGLang's native /generate for SGLang
// pools); anything else goes to a decode endpoint as is.
func pdInference(st *service, req *proxy.Request) bool {
	if req.Method != http.MethodPost {
		return false
	}
	spec, ok := engine.Lookup(st.rule.Engine())
	return ok && slices.Contains(spec.PDPaths, req.Path)
}

// generateHashBlockers are /generate fields that make SGLang's page hashes
// depend on more than the token ids (or that replace the ids).
var generateHashBlockers = []string{"input_embeds", "lora_path", "lora_id", "image_data", "video_data", "audio_data", "cache_salt"}

// generateTokens is promptTokens for SGLang's /generate. input_ids are
// the prompt as the engine hashes it; text is tokenized as SGLang
// tokenizes it, the same way as a /v1/completions prompt (the rule's
// profile applies). A batch keys on its first prompt, as a list of
// completions prompts does. A body the dispatcher will refuse yields no
// keys (the dispatcher answers 400).
func (g *Gateway) generateTokens(ctx context.Context, st *service, model string, req *proxy.Request) ([]uint32, string, error) {
	var m map[string]json.RawMessage
	if json.Unmarshal(req.Body, &m) != nil || m == nil {
		return nil, router.ReasonUnhashable, nil
	}
	for _, k := range generateHashBlockers {
		if v, ok := m[k]; ok && !isJSONNull(v) {
			g.m.unhashable(st.label, k)
			return nil, router.ReasonUnhashable, nil
		}
	}
	if v, ok := m["input_ids"]; ok && !isJSONNull(v) {
		var ids []uint32
		if json.Unmarshal(v, &ids) != nil {
			var many [][]uint32
			if json.Unmarshal(v, &many) != nil || len(many) == 0 {
				return nil, router.ReasonUnhashable, nil
			}
			ids = many[0]
		}
		if len(ids) == 0 {
			return nil, router.ReasonUnhashable, nil
		}
		// The same bound as a tokenized prompt's.
		limit := g.cfg.MaxPromptTokens
		if limit <= 0 {
			limit = DefaultMaxPromptTokens
		}
		if len(ids) > limit {
			g.m.rejected(st.label, rejectPrompt)
			err := fmt.Errorf("%w: /generate input_ids has %d tokens, more than the %d this gateway accepts", proxy.ErrBadRequest, len(ids), limit)
			g.logReject(st, rejectPrompt, err)
			return nil, "", err
		}
		return ids, "", nil
	}
	var text string
	if json.Unmarshal(m["text"], &text) != nil {
		var many []string
		if json.Unmarshal(m["text"], &many) != nil || len(many) == 0 {
			return nil, router.ReasonUnhashable, nil
		}
		text = many[0]
	}
	if model == "" {
		g.m.missed(st.label, ReasonNoModel)
		return nil, ReasonNoModel, nil
	}
	body, _ := json.Marshal(map[string]string{"model": model, "prompt": text})
	creq := *req
	creq.Path, creq.Body = "/v1/completions", body
	return g.promptTokens(ctx, st, model, &creq)
}

func isJSONNull(v json.RawMessage) bool {
	t := bytes.TrimSpace(v)
	return len(t) == 0 || string(t) == "null"
}
