package kvevents

import (
	"testing"
)

func FuzzDecodeBatch(f *testing.F) {
	for _, file := range []string{"vllm_event_vectors.json", "sglang_event_vectors.json"} {
		for _, v := range loadEventVectors(f, file) {
			_, _, p := v.frames(f)
			f.Add(p)
		}
	}
	f.Add([]byte{0x92, 0x00, 0x90})
	f.Add([]byte{0xdf, 0xff, 0xff, 0xff, 0xff})
	f.Fuzz(func(t *testing.T, p []byte) {
		var b Batch
		for _, order := range []KeyOrder{KeyLast8, KeyFirst8} {
			if err := NewDecoder(order).Decode(p, &b); err != nil {
				continue
			}
			for _, e := range b.Events {
				if len(e.Hashes) > len(p) || len(e.Tokens) > len(p) {
					t.Fatalf("decoded more items than payload bytes")
				}
			}
		}
	})
}

func FuzzMsgpackSkip(f *testing.F) {
	f.Add([]byte{0x93, 0x01, 0x92, 0xc0, 0xa1, 'x', 0x81, 0x01, 0x02})
	f.Fuzz(func(t *testing.T, p []byte) {
		var r mpReader
		r.reset(p)
		for r.remaining() > 0 {
			before := r.off
			if err := r.skip(); err != nil {
				return
			}
			if r.off <= before {
				t.Fatal("skip made no progress")
			}
		}
	})
}

func FuzzDecodeTRTLLMBody(f *testing.F) {
	f.Add(loadTRTBody(f))
	f.Add([]byte(`[{"event_id":1,"data":{"type":"stored","parent_hash":null,"blocks":[]}}]`))
	f.Add([]byte(`[{"event_id":2,"data":{"type":"removed","block_hashes":[18446744073709551615]}}]`))
	f.Fuzz(func(t *testing.T, body []byte) {
		evs, _, err := DecodeTRTLLMBody(body)
		if err != nil && len(evs) != 0 {
			t.Fatal("events returned with a body error")
		}
	})
}

func FuzzServerInfoGeometry(f *testing.F) {
	f.Add([]byte(`{"kv_cache_hash_algo":"v1_block_key","tokens_per_block":32}`))
	f.Add([]byte(`{"kv_cache_config":{"tokens_per_block":16}}`))
	f.Add([]byte(`{"disaggregated_params":{}}`))
	f.Fuzz(func(t *testing.T, body []byte) {
		algo, tpb, err := serverInfoGeometry(body)
		if err == nil && tpb == 0 {
			t.Fatalf("tokens_per_block 0 accepted (algo %q)", algo)
		}
	})
}
