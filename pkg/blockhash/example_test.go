package blockhash_test

import (
	"fmt"

	"github.com/loxilb-llm/loxilb/pkg/blockhash"
)

// Request side: one key per full block, as the engine publishes it.
func ExampleHasher_Keys() {
	h, err := blockhash.New(blockhash.Config{Algo: blockhash.SHA256SGLang, BlockSize: 16})
	if err != nil {
		panic(err)
	}
	toks := make([]uint32, 50) // 3 full pages of 16; the last 2 tokens are not hashed
	for i := range toks {
		toks[i] = uint32(i + 1)
	}
	for _, k := range h.Keys(nil, toks) {
		fmt.Println(blockhash.FormatKey(h.Algo(), k))
	}
	// Output:
	// 8635429971592222890
	// 1256577331724852459
	// 5689809685380680247
}

// Event side: recompute a published chain from its token ids and check it
// against the keys the request side computes for the same tokens.
func ExampleHasher_Next() {
	h, err := blockhash.New(blockhash.Config{Algo: blockhash.SHA256CBOR, BlockSize: 4, Seed: "0"})
	if err != nil {
		panic(err)
	}
	toks := []uint32{1, 2, 3, 4, 5, 6, 7, 8}
	want := h.Keys(nil, toks)
	parent := h.Root() // NONE_HASH for seed "0"
	fmt.Println(parent)
	for i := 0; i < len(toks); i += 4 {
		var key uint64
		parent, key = h.Next(parent, toks[i:i+4])
		fmt.Println(key == want[i/4])
	}
	// Output:
	// 4e1195df020de59e0d65a33a4279f1183e7ae4e5d980e309f8b55adff2e61c3e
	// true
	// true
}
