package tokenizer

import (
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"testing"
)

// BenchmarkEncodePrompt tokenizes the ~2,000-token benchmark prompt (the
// same bytes testbed/parity/regen.sh times with the Rust tokenizer) and
// reports ns/token and tokens/s. The segment cache is emptied before every
// encode (the prompt is new), the word cache stays warm.
func BenchmarkEncodePrompt(b *testing.B) {
	prompt, err := os.ReadFile("testdata/bench_prompt.txt")
	if err != nil {
		b.Fatal(err)
	}
	text := string(prompt)
	for _, m := range parityModels {
		b.Run(m.name, func(b *testing.B) {
			tk := loadStaged(b, m.slug)
			n := len(tk.Encode(text, false))
			buf := make([]uint32, 0, n)
			b.SetBytes(int64(len(text)))
			b.ReportAllocs()
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				b.StopTimer()
				tk.cache.reset() // a prompt never seen whole
				b.StartTimer()
				buf = tk.AppendEncode(buf[:0], text, false)
			}
			reportTokens(b, n)
		})
	}
}

// BenchmarkEncodePromptColdCache is the same with the per-word BPE cache
// emptied before every encode too: the worst case for a never-seen prompt.
func BenchmarkEncodePromptColdCache(b *testing.B) {
	prompt, err := os.ReadFile("testdata/bench_prompt.txt")
	if err != nil {
		b.Fatal(err)
	}
	text := string(prompt)
	for _, m := range parityModels {
		b.Run(m.name, func(b *testing.B) {
			tk := loadStaged(b, m.slug)
			n := len(tk.Encode(text, false))
			b.ReportAllocs()
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				b.StopTimer()
				tk.model.cache.reset()
				tk.cache.reset()
				b.StartTimer()
				tk.Encode(text, false)
			}
			reportTokens(b, n)
		})
	}
}

// BenchmarkEncodePromptNewEnding tokenizes the benchmark prompt with a
// different last sentence every time (a new question after the same
// document): the prefix cache holds the previous version, so the encode
// resumes near the end; the word cache is warm.
func BenchmarkEncodePromptNewEnding(b *testing.B) {
	prompt, err := os.ReadFile("testdata/bench_prompt.txt")
	if err != nil {
		b.Fatal(err)
	}
	for _, m := range parityModels {
		b.Run(m.name, func(b *testing.B) {
			tk := loadStaged(b, m.slug)
			texts := make([]string, b.N+1)
			for i := range texts {
				texts[i] = fmt.Sprintf("%s Question %d: which endpoint holds this prefix?", prompt, i)
			}
			n := len(tk.Encode(texts[0], false))
			buf := make([]uint32, 0, 2*n)
			runtime.GC() // the load's garbage is not this loop's
			b.ReportAllocs()
			b.ResetTimer()
			for i := 1; i <= b.N; i++ {
				buf = tk.AppendEncode(buf[:0], texts[i], false)
			}
			reportTokens(b, n)
		})
	}
}

func reportTokens(b *testing.B, n int) {
	nsPerOp := float64(b.Elapsed().Nanoseconds()) / float64(b.N)
	b.ReportMetric(float64(n), "tokens/op")
	b.ReportMetric(nsPerOp/float64(n), "ns/token")
	b.ReportMetric(float64(n)/(nsPerOp/1e9), "tokens/s")
}

// BenchmarkEncodePromptRegexp2 is BenchmarkEncodePrompt on the general
// regexp2 pre-tokenizer path (the scanner switched off): the speed any
// tokenizer with an unfamiliar Split pattern gets.
func BenchmarkEncodePromptRegexp2(b *testing.B) {
	prompt, err := os.ReadFile("testdata/bench_prompt.txt")
	if err != nil {
		b.Fatal(err)
	}
	text := string(prompt)
	for _, m := range parityModels {
		b.Run(m.name, func(b *testing.B) {
			tk, err := Load(filepath.Join(stagedDir, m.slug))
			if err != nil {
				b.Fatal(err)
			}
			pattern := qwenPattern
			if m.name == "llama3_1" {
				pattern = llama3Pattern
			}
			if tk.pre.(*preSequence).steps[0].(*splitPre).m, err = newRegexMatcher(pattern); err != nil {
				b.Fatal(err)
			}
			tk.scan = nil // the pieces come from the regex again
			n := len(tk.Encode(text, false))
			buf := make([]uint32, 0, n)
			b.ReportAllocs()
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				b.StopTimer()
				tk.cache.reset() // a prompt never seen whole
				b.StartTimer()
				buf = tk.AppendEncode(buf[:0], text, false)
			}
			reportTokens(b, n)
		})
	}
}
