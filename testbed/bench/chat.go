package bench

import (
	"encoding/json"
	"fmt"
	"math"
	"math/rand/v2"
	"strings"
	"time"

	"github.com/loxilb-llm/loxilb/pkg/tokenizer"
)

// ChatBody is the prompt part of a /v1/chat/completions request: what the
// gateway and the engine render through the model's chat template.
type ChatBody struct {
	Messages []ChatMessage    `json:"messages"`
	Tools    []map[string]any `json:"tools,omitempty"`
}

// ChatMessage is one message of a chat request, tool calls included.
type ChatMessage struct {
	Role       string         `json:"role"`
	Content    string         `json:"content"`
	ToolCalls  []ChatToolCall `json:"tool_calls,omitempty"`
	ToolCallID string         `json:"tool_call_id,omitempty"`
}

// ChatToolCall is an assistant's call of a tool.
type ChatToolCall struct {
	ID       string `json:"id"`
	Type     string `json:"type"`
	Function struct {
		Name      string `json:"name"`
		Arguments string `json:"arguments"`
	} `json:"function"`
}

// words are common English words; random sequences of them tokenize to
// about one token per word, so text of n words is about n tokens, and two
// sequences share no prefix beyond their first word or two.
var words = strings.Fields(`the of and to in is was that for on are with as at be by this had not but from or have an they
which one you were her all she there would their we him been has when who will more no if out so said what up its about
into than them can only other new some could time these two may then do first any my now such like our over man me even
most made after also did many before must through back years where much your way well down should because each just
those people how too little state good very make world still own see men work long get here between both life being under
never day same another know while last might us great old year off come since against go came right used take three
states himself few house use during without again place american around however home small found thought went say part
once general high upon school every until always away something fact though water less public put think almost hand
enough far took head yet government system better set told nothing night end why called didn find look asked later point
knew city next program business give group toward young days let room president side social given present several order
national possible rather second face per among form important often things looked early white case large become big need
four within felt along children saw best church ever least power development light thing seemed family interest want
members mind country area others done turned although open problem various help sense means certain kind`)

// textGen makes seeded pseudo-English text.
type textGen struct{ r *rand.Rand }

func newTextGen(seed, stream uint64) *textGen {
	return &textGen{r: rand.New(rand.NewPCG(seed, stream))}
}

// text returns n words in sentences of 8 to 20 words.
func (g *textGen) text(n int) string {
	var b strings.Builder
	b.Grow(n * 7)
	left := 0
	for i := 0; i < n; i++ {
		w := words[g.r.IntN(len(words))]
		if left == 0 {
			if i > 0 {
				b.WriteString(". ")
			}
			left = 8 + g.r.IntN(13)
			w = strings.ToUpper(w[:1]) + w[1:]
		} else {
			b.WriteByte(' ')
		}
		b.WriteString(w)
		left--
	}
	b.WriteByte('.')
	return b.String()
}

// zipfPicker draws indices 0..n-1 with probability proportional to
// 1/(i+1)^s.
type zipfPicker struct{ cum []float64 }

func newZipf(n int, s float64) zipfPicker {
	z := zipfPicker{cum: make([]float64, n)}
	sum := 0.0
	for i := range z.cum {
		sum += 1 / math.Pow(float64(i+1), s)
		z.cum[i] = sum
	}
	return z
}

func (z zipfPicker) pick(r *rand.Rand) int {
	x := r.Float64() * z.cum[len(z.cum)-1]
	for i, c := range z.cum {
		if x <= c {
			return i
		}
	}
	return len(z.cum) - 1
}

// DocQASpec is document question answering through the chat path: a
// shared system prompt, one of Docs documents (Zipf popularity) in the
// user message, then a question; UniqueShare of the requests are instead
// one-shot prompts that share nothing but the system prompt.
type DocQASpec struct {
	Docs           int
	DocWords       int
	ZipfS          float64
	SystemWords    int
	QuestionWords  int
	UniqueShare    float64
	UniqueWords    int
	Requests       int
	OutputTokens   int
	RatePerSec     float64
	DocsOfFleetPct int // documentation only: the documents as % of fleet KV
}

// DocQA builds the workload: an open-loop Poisson arrival of requests.
func DocQA(name string, seed uint64, s DocQASpec) Workload {
	g := newTextGen(seed, 11)
	system := "You are a careful assistant. Answer the question using only the document the user provides. " + g.text(s.SystemWords)
	docs := make([]string, s.Docs)
	for i := range docs {
		docs[i] = fmt.Sprintf("Document %d.\n%s", i, g.text(s.DocWords))
	}
	z := newZipf(s.Docs, s.ZipfS)
	at := poisson(g.r, s.Requests, s.RatePerSec)
	w := Workload{Name: name,
		Title: fmt.Sprintf("Document Q&A (chat), %.0f%% one-shot prompts", 100*s.UniqueShare),
		Description: fmt.Sprintf("%d requests, Poisson %.0f req/s: %d documents of ~%d words (~%d%% of fleet KV) with Zipf(%.1f) popularity + a %d-word question; %.0f%% one-shot %d-word prompts; %d output tokens",
			s.Requests, s.RatePerSec, s.Docs, s.DocWords, s.DocsOfFleetPct, s.ZipfS, s.QuestionWords, 100*s.UniqueShare, s.UniqueWords, s.OutputTokens),
		Params: map[string]any{"docs": s.Docs, "doc_words": s.DocWords, "zipf_s": s.ZipfS, "system_words": s.SystemWords,
			"question_words": s.QuestionWords, "unique_share": s.UniqueShare, "unique_words": s.UniqueWords,
			"requests": s.Requests, "output_tokens": s.OutputTokens, "rate_per_sec": s.RatePerSec,
			"docs_percent_of_fleet_kv": s.DocsOfFleetPct, "path": "/v1/chat/completions"}}
	for i := 0; i < s.Requests; i++ {
		var r Req
		if g.r.Float64() < s.UniqueShare {
			r = Req{Group: -1, Chat: &ChatBody{Messages: []ChatMessage{{Role: "system", Content: system},
				{Role: "user", Content: g.text(s.UniqueWords)}}}}
		} else {
			d := z.pick(g.r)
			r = Req{Group: d, Chat: &ChatBody{Messages: []ChatMessage{{Role: "system", Content: system},
				{Role: "user", Content: docs[d] + "\n\nQuestion: " + g.text(s.QuestionWords) + "?"}}}}
		}
		r.MaxTokens = s.OutputTokens
		w.Streams = append(w.Streams, Stream{Start: at[i], Reqs: []Req{r}})
	}
	return w
}

// AgentSpec is an agent's tool loop through the chat path: every agent
// shares a system prompt and tool definitions, has its own task, and each
// step appends the assistant's tool call and the tool's result to the
// history before asking for the next step (closed loop: a step is sent
// Think after the previous one answered).
type AgentSpec struct {
	Agents, Steps int
	SystemWords   int
	TaskWords     int
	ResultWords   int // per tool result
	OutputTokens  int
	Think         time.Duration // tool execution time between steps
	Stagger       time.Duration // agents start this far apart
}

// agentTools are the tool definitions every agent request carries.
var agentTools = []map[string]any{
	{"type": "function", "function": map[string]any{"name": "search", "description": "Search the knowledge base and return the best passages.",
		"parameters": map[string]any{"type": "object", "properties": map[string]any{"query": map[string]any{"type": "string"}}, "required": []string{"query"}}}},
	{"type": "function", "function": map[string]any{"name": "read_file", "description": "Read a file of the workspace.",
		"parameters": map[string]any{"type": "object", "properties": map[string]any{"path": map[string]any{"type": "string"}}, "required": []string{"path"}}}},
	{"type": "function", "function": map[string]any{"name": "run", "description": "Run a shell command in the sandbox and return its output.",
		"parameters": map[string]any{"type": "object", "properties": map[string]any{"cmd": map[string]any{"type": "string"}}, "required": []string{"cmd"}}}},
}

// AgentLoop builds the workload: one closed-loop stream per agent.
func AgentLoop(name string, seed uint64, s AgentSpec) Workload {
	g := newTextGen(seed, 12)
	system := "You are an autonomous engineering agent. Use the tools to complete the task, one call at a time. " + g.text(s.SystemWords)
	names := []string{"search", "read_file", "run"}
	args := []string{"query", "path", "cmd"}
	w := Workload{Name: name, Title: "Agent tool loops (chat), growing histories",
		Description: fmt.Sprintf("%d agents x %d steps, shared %d-word system prompt + 3 tool definitions, %d-word task, +1 tool call and a %d-word tool result per step, next step %v after the answer",
			s.Agents, s.Steps, s.SystemWords, s.TaskWords, s.ResultWords, s.Think),
		Params: map[string]any{"agents": s.Agents, "steps": s.Steps, "system_words": s.SystemWords, "task_words": s.TaskWords,
			"result_words": s.ResultWords, "output_tokens": s.OutputTokens, "think_ms": s.Think.Milliseconds(),
			"stagger_ms": s.Stagger.Milliseconds(), "path": "/v1/chat/completions"}}
	for a := 0; a < s.Agents; a++ {
		msgs := []ChatMessage{{Role: "system", Content: system}, {Role: "user", Content: "Task: " + g.text(s.TaskWords)}}
		st := Stream{Start: time.Duration(a) * s.Stagger, Think: s.Think}
		for k := 0; k < s.Steps; k++ {
			if k > 0 {
				t := g.r.IntN(len(names))
				call := ChatToolCall{ID: fmt.Sprintf("call_%d_%d", a, k), Type: "function"}
				call.Function.Name = names[t]
				a, _ := json.Marshal(map[string]string{args[t]: g.text(4)})
				call.Function.Arguments = string(a)
				msgs = append(msgs, ChatMessage{Role: "assistant", ToolCalls: []ChatToolCall{call}},
					ChatMessage{Role: "tool", ToolCallID: call.ID, Content: g.text(s.ResultWords)})
			}
			st.Reqs = append(st.Reqs, Req{Group: a, Turn: k, MaxTokens: s.OutputTokens,
				Chat: &ChatBody{Messages: append([]ChatMessage(nil), msgs...), Tools: agentTools}})
		}
		w.Streams = append(w.Streams, st)
	}
	return w
}

// ChatWorkloads are the chat-path workloads of the default suite for
// fleet f: the documents exceed the fleet's KV, so popularity decides
// what stays cached, and the mixes add one-shot prompts that match
// nothing, which a KV router must place without hurting the hits.
func ChatWorkloads(seed uint64, f FleetConfig) []Workload {
	const docWords = 1400 // ~1.5k tokens with the template and question
	docs := f.TotalBlocks() * f.BlockSize * 160 / 100 / 1500
	pct := 100 * docs * 1500 / (f.TotalBlocks() * f.BlockSize)
	qa := DocQASpec{Docs: docs, DocWords: docWords, ZipfS: 1.0, SystemWords: 100, QuestionWords: 40,
		UniqueWords: 1000, Requests: 320, OutputTokens: 2, RatePerSec: 60, DocsOfFleetPct: pct}
	mixed := qa
	mixed.UniqueShare = 0.5
	heavy := mixed
	heavy.RatePerSec = 80
	return []Workload{
		DocQA(WDocQA, seed, qa),
		DocQA(WDocQAMixed, seed, mixed),
		DocQA(WDocQAMixedHeavy, seed, heavy),
		AgentLoop(WAgentLoop, seed, AgentSpec{Agents: 12, Steps: 10, SystemWords: 700, TaskWords: 200, ResultWords: 300,
			OutputTokens: 2, Think: 40 * time.Millisecond, Stagger: 25 * time.Millisecond}),
	}
}

// tokenizeChat fills Tokens of every chat request of w with the ids the
// engines compute for it (model tokenizer, chat template of engine), so
// the fleet-LRU bound and the receipts count what the engines cache.
func tokenizeChat(w *Workload, tok *tokenizer.Tokenizer, engine string) error {
	for si := range w.Streams {
		for ri := range w.Streams[si].Reqs {
			r := &w.Streams[si].Reqs[ri]
			if r.Chat == nil || r.Tokens != nil {
				continue
			}
			body, err := json.Marshal(r.Chat)
			if err != nil {
				return err
			}
			rt, err := tok.EncodeRequest(engine, "/v1/chat/completions", body)
			if err != nil {
				return fmt.Errorf("%s: stream %d request %d: %w", w.Name, si, ri, err)
			}
			if rt.Unhashable != "" {
				return fmt.Errorf("%s: stream %d request %d: the gateway would not hash it: %s", w.Name, si, ri, rt.Unhashable)
			}
			r.Tokens = rt.IDs
		}
	}
	return nil
}
