package enginesim

import (
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
)

func BenchmarkHashBlocks(b *testing.B) {
	toks := make([]uint32, 4096)
	for i := range toks {
		toks[i] = uint32(i * 7919)
	}
	for _, c := range []struct{ engine, algo string }{
		{EngineVLLM, AlgoSHA256CBOR}, {EngineVLLM, AlgoXXHashCBOR}, {EngineSGLang, AlgoSHA256SGLang}, {EngineTRTLLM, AlgoBlockHashTRTLLM},
	} {
		h, err := newHasher(c.engine, c.algo, "0", 16)
		if err != nil {
			b.Fatal(err)
		}
		b.Run(c.algo, func(b *testing.B) {
			b.SetBytes(int64(len(toks) * 4))
			for b.Loop() {
				h.hashBlocks(toks)
			}
		})
	}
}

// BenchmarkCompletionHit measures the emulator's own per-request overhead
// (no modelled delays, no sockets) for a 2,048-token prompt that hits.
func BenchmarkCompletionHit(b *testing.B) {
	e, err := New(Config{Engine: EngineVLLM, ZMQPort: -1, TimeScaleSet: true}, Deps{})
	if err != nil {
		b.Fatal(err)
	}
	defer e.Close()
	ids := make([]string, 2048)
	for i := range ids {
		ids[i] = fmt.Sprint(i + 1)
	}
	body := `{"prompt": [` + strings.Join(ids, ",") + `], "max_tokens": 4}`
	h := e.Handler()
	for b.Loop() {
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, httptest.NewRequest(http.MethodPost, "/v1/completions", strings.NewReader(body)))
		if rec.Code != 200 {
			b.Fatal(rec.Code, rec.Body.String())
		}
	}
}
