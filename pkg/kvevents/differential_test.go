package kvevents

import (
	"bytes"
	"encoding/binary"
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/vmihailenco/msgpack/v5"
)

// TestDecoderAgainstThirdPartyEncoder encodes random batches in every shape
// the engines use with an independent msgpack implementation and checks the
// hand-rolled decoder recovers every field.
func TestDecoderAgainstThirdPartyEncoder(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 4))
	type want struct {
		kind      EventKind
		hashes    []uint64
		parent    uint64
		hasParent bool
		tokens    []uint32
		bs        int
		medium    string
	}
	for iter := 0; iter < 2000; iter++ {
		sglang := rng.IntN(2) == 0
		order := KeyLast8
		if sglang {
			order = KeyFirst8
		}
		asMap := rng.IntN(2) == 0
		hashForm := rng.IntN(3) // 0 unsigned, 1 signed, 2 bytes
		var evs []any
		var wants []want
		for e := 0; e < 1+rng.IntN(5); e++ {
			w := want{kind: EventKind(1 + rng.IntN(3)), bs: -1}
			enc := func(k uint64) any {
				switch hashForm {
				case 1:
					return int64(k)
				case 2:
					d := make([]byte, 32)
					for i := range d {
						d[i] = byte(rng.IntN(256))
					}
					if order == KeyFirst8 {
						binary.BigEndian.PutUint64(d[:8], k)
					} else {
						binary.BigEndian.PutUint64(d[24:], k)
					}
					return d
				}
				return k
			}
			var hs []any
			if w.kind != KindCleared {
				for i := 0; i < rng.IntN(4); i++ {
					k := rng.Uint64() >> uint(rng.IntN(64))
					w.hashes = append(w.hashes, k)
					hs = append(hs, enc(k))
				}
				if hs == nil {
					hs = []any{}
				}
				w.medium = []string{"", "GPU", "CPU_PINNED"}[rng.IntN(3)]
			}
			var parent any
			var toks []any
			if w.kind == KindStored {
				if rng.IntN(2) == 0 {
					w.parent, w.hasParent = rng.Uint64(), true
					parent = enc(w.parent)
				}
				for i := 0; i < rng.IntN(40); i++ {
					tk := uint32(rng.Uint64() >> uint(32+rng.IntN(32)))
					w.tokens = append(w.tokens, tk)
					toks = append(toks, tk)
				}
				w.bs = rng.IntN(300)
			}
			var medium any
			if w.medium != "" {
				medium = w.medium
			}
			tag := map[EventKind]string{KindStored: "BlockStored", KindRemoved: "BlockRemoved", KindCleared: "AllBlocksCleared"}[w.kind]
			switch {
			case asMap:
				m := map[string]any{"type": tag, "future_field": []any{1, "x"}}
				if w.kind != KindCleared {
					m["block_hashes"] = hs
					m["medium"] = medium
				}
				if w.kind == KindStored {
					m["parent_block_hash"] = parent
					m["token_ids"] = toks
					m["block_size"] = w.bs
					m["lora_id"] = nil
				}
				evs = append(evs, m)
			case w.kind == KindStored:
				evs = append(evs, []any{tag, hs, parent, toks, w.bs, nil, medium, nil, []any{nil}, 0, "full_attention"}[:4+rng.IntN(8)])
				if len(evs[len(evs)-1].([]any)) < 7 {
					w.medium = ""
				}
				if len(evs[len(evs)-1].([]any)) < 5 {
					w.bs = -1
				}
			case w.kind == KindRemoved:
				evs = append(evs, []any{tag, hs, medium})
			default:
				evs = append(evs, []any{tag})
			}
			wants = append(wants, w)
		}
		var batch any = []any{1.5, evs, 0}
		if rng.IntN(4) == 0 {
			batch = map[string]any{"ts": 1.5, "events": evs, "data_parallel_rank": 0}
		}
		var buf bytes.Buffer
		en := msgpack.NewEncoder(&buf)
		en.UseCompactInts(rng.IntN(2) == 0)
		if err := en.Encode(batch); err != nil {
			t.Fatal(err)
		}
		var b Batch
		if err := NewDecoder(order).Decode(buf.Bytes(), &b); err != nil {
			t.Fatalf("iter %d: %v (%x)", iter, err, buf.Bytes())
		}
		if len(b.Events) != len(wants) || b.Rank != 0 {
			t.Fatalf("iter %d: %d events rank %d", iter, len(b.Events), b.Rank)
		}
		for i, w := range wants {
			e := b.Events[i]
			if e.Kind != w.kind || !slices.Equal(e.Hashes, w.hashes) || e.HasParent != w.hasParent || e.Parent != w.parent ||
				!slices.Equal(e.Tokens, w.tokens) || e.BlockSize != w.bs || string(e.Medium) != w.medium {
				t.Fatalf("iter %d event %d:\n got %+v\nwant %+v", iter, i, e, w)
			}
		}
	}
}
