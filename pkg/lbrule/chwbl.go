package lbrule

// Consistent-hash key settings (sel 8 chwbl, sel 10 wrr-hash), loxilb's
// chwbl_* fields. The key is model + the prompt prefix at a depth chosen by
// the level, plus the optional request fields the flags select.
const (
	// ChwblLevelSystem keys on model + the leading system/developer
	// messages (loxilb's level 1). Every request of a service that shares
	// one system prompt gets one key: only the load bound spreads them.
	ChwblLevelSystem = 1
	// ChwblLevelConversation adds the first user message: a conversation
	// keeps its key as its history grows, distinct conversations spread.
	// The default here; loxilb's binary defaults to 1.
	ChwblLevelConversation = 2
	// ChwblLevelOpening adds every message before the first assistant
	// turn (RAG context sent as extra user or tool messages).
	ChwblLevelOpening = 3

	DefaultChwblLevel = ChwblLevelConversation
	maxChwblLevel     = 3
	maxChwblFlags     = 255
	// DefaultChwblMeanLoadFactor is the runtime default of loxilb's binary
	// (its schema says 125).
	DefaultChwblMeanLoadFactor = 175
	minChwblMeanLoadFactor     = 100
	maxChwblMeanLoadFactor     = 1000
	// DefaultChwblReplication is the ring points per endpoint when the
	// rule does not set chwbl_replication.
	DefaultChwblReplication = 256
	maxChwblReplication     = 1024
)

// chwbl_prefix_hash_flags bits: which optional request fields join the key.
// 0 means auto: every one the request carries.
const (
	ChwblFlagLoRA         = 1 << 0 // lora_path / lora_request
	ChwblFlagImage        = 1 << 1 // image parts of the keyed messages
	ChwblFlagAudio        = 1 << 2 // audio parts of the keyed messages
	ChwblFlagCacheSalt    = 1 << 3 // cache_salt
	ChwblFlagTools        = 1 << 4 // tools
	ChwblFlagSession      = 1 << 5 // the session_header_name header's value
	ChwblFlagRAGTemplate  = 1 << 6 // chat_template, chat_template_kwargs
	ChwblFlagRAGDocuments = 1 << 7 // documents
)

// IsHashSel reports whether sel keys a consistent-hash ring (chwbl_* apply).
func IsHashSel(sel int) bool { return sel == SelCHWBL || sel == SelWRRHash }

// ChwblLevel returns the effective prefix-hash level.
func (r *Rule) ChwblLevel() int {
	if r.Service.ChwblPrefixHashLevel == 0 {
		return DefaultChwblLevel
	}
	return r.Service.ChwblPrefixHashLevel
}

// ChwblMeanLoadFactor returns the effective bounded-load factor in percent.
func (r *Rule) ChwblMeanLoadFactor() int {
	if r.Service.ChwblMeanLoadFactor == 0 {
		return DefaultChwblMeanLoadFactor
	}
	return r.Service.ChwblMeanLoadFactor
}

// ChwblReplication returns the effective ring points per endpoint.
func (r *Rule) ChwblReplication() int {
	if r.Service.ChwblReplication == 0 {
		return DefaultChwblReplication
	}
	return r.Service.ChwblReplication
}

func validateChwbl(s *ServiceArgs) error {
	if v := s.ChwblPrefixHashLevel; v < 0 || v > maxChwblLevel {
		return invalid(svcField("chwbl_prefix_hash_level"), "%d is not 1 (system prompt + model), 2 (+ first user message) or 3 (+ every message before the first assistant turn); 0 = default %d", v, DefaultChwblLevel)
	}
	if v := s.ChwblPrefixHashFlags; v < 0 || v > maxChwblFlags {
		return invalid(svcField("chwbl_prefix_hash_flags"), "%d is out of range 0..255 (bit0 LoRA, 1 image, 2 audio, 3 cache_salt, 4 tools, 5 session, 6 RAG template, 7 RAG documents; 0 = auto)", v)
	}
	if v := s.ChwblMeanLoadFactor; v != 0 && (v < minChwblMeanLoadFactor || v > maxChwblMeanLoadFactor) {
		return invalid(svcField("chwbl_mean_load_factor"), "%d is out of range %d..%d percent (0 = default %d)", v, minChwblMeanLoadFactor, maxChwblMeanLoadFactor, DefaultChwblMeanLoadFactor)
	}
	if v := s.ChwblReplication; v < 0 || v > maxChwblReplication {
		return invalid(svcField("chwbl_replication"), "%d is out of range 1..%d ring points per endpoint (0 = default %d)", v, maxChwblReplication, DefaultChwblReplication)
	}
	return nil
}
