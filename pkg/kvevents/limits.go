package kvevents

// Defaults of the input limits (the daemon reads them from its settings
// table, cmd/loxilb, with their ranges). A ZMQ message or a TensorRT-LLM
// drain body larger than MaxMessageBytes is refused before it is buffered;
// a batch announcing more events, block hashes or token ids than the batch
// limits is refused before they are decoded, so a peer cannot make the
// gateway hold much more than the bytes it sent.
const (
	DefaultMaxMessageBytes  = 16 << 20
	DefaultMaxMessageFrames = 16
	DefaultMaxBatchEvents   = 1 << 16
	DefaultMaxBatchHashes   = 1 << 20
	DefaultMaxBatchTokens   = 1 << 22
	DefaultTRTMaxHeaderB    = 64 << 10
	// DefaultQuarantineVerifyBlocks is how many consecutive verified
	// blocks lift the quarantine of an endpoint whose publisher sent
	// blocks that fail attestation.
	DefaultQuarantineVerifyBlocks = 64
	// DefaultReplayMaxBatches bounds the batches of one replay exchange.
	DefaultReplayMaxBatches = 1 << 16
)
