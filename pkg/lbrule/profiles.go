package lbrule

import (
	"sort"
	"strings"
)

// ModelProfile is a built-in kvModelProfile: how an engine deployment
// renders prompts where it departs from the engine's defaults. The block
// hashes the gateway computes must equal the engine's, so a profile changes
// how requests are tokenized for KV-exact routing.
type ModelProfile struct {
	Name string
	// Engine is the only engine the profile applies to; "" fits all.
	Engine string
	// CompletionsBOS: /v1/completions prompts are BOS + text encoded
	// without the tokenizer's post-processor, whatever the request says
	// (SGLang deployments whose model metadata sets completionsBos).
	CompletionsBOS bool
	Doc            string
}

var modelProfiles = map[string]ModelProfile{
	"default": {Name: "default", Doc: "the engine's own defaults (same as no profile)"},
	"sglang-completions-bos": {Name: "sglang-completions-bos", Engine: "sglang", CompletionsBOS: true,
		Doc: "SGLang completionsBos:true: /v1/completions prompts are BOS + text, no post-processor"},
}

// ModelProfiles lists the built-in profiles by name.
func ModelProfiles() []ModelProfile {
	out := make([]ModelProfile, 0, len(modelProfiles))
	for _, p := range modelProfiles {
		out = append(out, p)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Name < out[j].Name })
	return out
}

// Profile returns the rule's model profile (the default one when unset).
func (r *Rule) Profile() ModelProfile {
	if p, ok := modelProfiles[r.Service.KVModelProfile]; ok {
		return p
	}
	return modelProfiles["default"]
}

func validateProfile(r *Rule) error {
	s := &r.Service
	if s.KVModelProfile == "" {
		return nil
	}
	p, ok := modelProfiles[s.KVModelProfile]
	if !ok {
		names := make([]string, 0, len(modelProfiles))
		for _, p := range ModelProfiles() {
			names = append(names, p.Name)
		}
		return invalid(svcField("kvModelProfile"), "%q is not a known model profile (have %s)", s.KVModelProfile, strings.Join(names, ", "))
	}
	if s.KVExactMode != KVExactPD && s.KVExactMode != KVExactSingle {
		return invalid(svcField("kvModelProfile"), "is meaningless without kvExactMode 1 or 3: a profile only changes how prompts are hashed")
	}
	if p.Engine != "" && r.Engine() != p.Engine {
		return invalid(svcField("kvModelProfile"), "%q applies to kv-engine-type %s, not %s", p.Name, p.Engine, r.Engine())
	}
	return nil
}
