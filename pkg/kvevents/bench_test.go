package kvevents

import (
	"math/rand/v2"
	"testing"

	"github.com/loxilb-llm/loxilb/pkg/blockhash"
)

type nopSink struct{}

func (nopSink) Store(uint32, int, int, []uint64)  {}
func (nopSink) Remove(uint32, int, int, []uint64) {}
func (nopSink) ClearRank(uint32, int, int)        {}
func (nopSink) ClearEndpoint(uint32, int)         {}

// benchPayload is a current-vLLM batch (map events): nEvents BlockStored
// runs of blocksPer blocks (16 tokens each, keys from the real contract) and
// as many BlockRemoved events. It returns the payload and its block events.
func benchPayload(b *testing.B, nEvents, blocksPer int) ([]byte, int) {
	h, err := blockhash.New(blockhash.Config{Algo: blockhash.SHA256CBOR, BlockSize: 16, Seed: "42"})
	if err != nil {
		b.Fatal(err)
	}
	rng := rand.New(rand.NewPCG(1, 2))
	var m mp
	m.arr(3).f64(0).arr(2 * nEvents)
	var all [][]uint64
	for e := 0; e < nEvents; e++ {
		toks := make([]uint32, 16*blocksPer)
		for i := range toks {
			toks[i] = uint32(rng.IntN(150000))
		}
		var d blockhash.Digest
		keys := make([]uint64, blocksPer)
		for i := range keys {
			d, keys[i] = h.Next(d, toks[i*16:(i+1)*16])
		}
		all = append(all, keys)
		m.mapN(8).str("type").str("BlockStored").str("block_hashes").arr(blocksPer)
		for _, k := range keys {
			m.u64(k)
		}
		m.str("parent_block_hash").nil_().str("token_ids").arr(len(toks))
		for _, t := range toks {
			m.WriteByte(0xce)
			m.Write([]byte{byte(t >> 24), byte(t >> 16), byte(t >> 8), byte(t)})
		}
		m.str("block_size").fix(16).str("medium").str("GPU").str("group_idx").fix(0).str("kv_cache_spec_kind").str("full_attention")
	}
	for _, keys := range all {
		m.mapN(3).str("type").str("BlockRemoved").str("block_hashes").arr(len(keys))
		for _, k := range keys {
			m.u64(k)
		}
		m.str("medium").str("GPU")
	}
	m.fix(0)
	return m.Bytes(), 2 * nEvents * blocksPer
}

func benchDecodeApply(b *testing.B, seed string) {
	payload, blocks := benchPayload(b, 32, 4)
	m := New(Config{}, nopSink{}, nil, nil)
	spec := Spec{Service: 1, Engine: EngineVLLM, Host: "127.0.0.1", ZmqPort: 5557, BlockSize: 16, HashAlgo: "sha256_cbor", Seed: seed}
	s := newSubscription(m, spec)
	z := &zmqRank{s: s, rs: s.ranks[0], dec: NewDecoder(KeyLast8)}
	b.SetBytes(int64(len(payload)))
	b.ReportAllocs()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		z.apply(uint64(i), payload)
	}
	b.ReportMetric(float64(blocks)*float64(b.N)/b.Elapsed().Seconds(), "block-events/s")
	if st := s.status(); st.DecodeErrors != 0 {
		b.Fatalf("decode errors: %+v", st)
	}
}

// BenchmarkDecodeApply is the ingestion hot path: decode a batch, filter it,
// apply it to the sink, attest parity (sampled once established).
func BenchmarkDecodeApply(b *testing.B) { benchDecodeApply(b, "42") }

// BenchmarkDecodeApplyParityMismatch runs with a wrong seed: every sampled
// event misses, and the alternative algorithm is tried too.
func BenchmarkDecodeApplyParityMismatch(b *testing.B) { benchDecodeApply(b, "0") }

func BenchmarkDecodeOnly(b *testing.B) {
	payload, blocks := benchPayload(b, 32, 4)
	d := NewDecoder(KeyLast8)
	var batch Batch
	b.SetBytes(int64(len(payload)))
	b.ReportAllocs()
	for i := 0; i < b.N; i++ {
		if err := d.Decode(payload, &batch); err != nil {
			b.Fatal(err)
		}
	}
	b.ReportMetric(float64(blocks)*float64(b.N)/b.Elapsed().Seconds(), "block-events/s")
}

func BenchmarkDecodeTRTLLM(b *testing.B) {
	body := loadTRTBody(b)
	b.SetBytes(int64(len(body)))
	b.ReportAllocs()
	for i := 0; i < b.N; i++ {
		if _, errs, err := DecodeTRTLLMBody(body); err != nil || len(errs) > 0 {
			b.Fatal(err, errs)
		}
	}
}
