package tokenizer

import (
	"encoding/json"
	"errors"
	"fmt"
	"regexp"
	"strings"

	"github.com/ardanlabs/jinja"
)

// ErrNoChatTemplate is returned when a chat request is rendered with a
// tokenizer whose tokenizer_config.json has no chat_template.
var ErrNoChatTemplate = errors.New("tokenizer has no chat_template")

// Message is one chat message with plain string content. Requests with
// content parts, tool calls or extra keys are rendered from their raw JSON
// (RenderChatJSON) so that every key reaches the template in request order.
type Message struct {
	Role    string `json:"role"`
	Content string `json:"content"`
}

// ChatOptions are the template inputs besides the messages, as an
// OpenAI-compatible server passes them to apply_chat_template.
type ChatOptions struct {
	// AddGenerationPrompt defaults to true (the OpenAI servers' default).
	AddGenerationPrompt *bool
	// ContinueFinalMessage cuts the render right after the final message's
	// content, as HuggingFace apply_chat_template(continue_final_message=True).
	ContinueFinalMessage bool
	// Tools and Documents are JSON arrays (nil: the template sees none).
	Tools     json.RawMessage
	Documents json.RawMessage
	// Kwargs is a JSON object of extra template variables
	// (chat_template_kwargs, e.g. {"enable_thinking": false}).
	Kwargs json.RawMessage
	// PartSeparator joins the text parts of a content list when the
	// template expects string content. Empty means "\n" (vLLM, TRT-LLM).
	PartSeparator string
	// ParseToolArguments turns tool_calls[].function.arguments given as a
	// JSON string into an object before rendering, as vLLM and SGLang do
	// so that templates can apply tojson to it.
	ParseToolArguments bool
	// TemplateName selects a named template when tokenizer_config.json
	// holds a list of them (e.g. "tool_use"); empty selects the default,
	// or "tool_use" when tools are given and such a template exists.
	TemplateName string
}

type chatTemplate struct {
	tmpl *jinja.Template
	// openAIContent is true when the template iterates over message
	// content itself (content parts reach it as a list); otherwise the
	// engines flatten text parts to a string first.
	openAIContent bool
}

// contentLoop spots templates that loop over a message's content, the same
// property vLLM's and SGLang's content-format detection looks for.
var contentLoop = regexp.MustCompile(`for\s+\w+\s+in\s+[\w.]*?(?:\.content|\[\s*['"]content['"]\s*\])`)

func compileChatTemplate(src string) (*chatTemplate, error) {
	t, err := jinja.Compile(splitConcatOutputs(rewriteTojson(src)))
	if err != nil {
		return nil, fmt.Errorf("compile chat_template: %w", err)
	}
	return &chatTemplate{tmpl: t, openAIContent: contentLoop.MatchString(src)}, nil
}

// RenderChat renders plain-text messages with the model's chat template.
func (t *Tokenizer) RenderChat(messages []Message, opts ChatOptions) (string, error) {
	raw, err := json.Marshal(messages)
	if err != nil {
		return "", fmt.Errorf("marshal messages: %w", err)
	}
	return t.RenderChatJSON(raw, opts)
}

// RenderChatJSON renders messages given as the JSON array of an OpenAI chat
// request. Objects keep their key order all the way into the template, so
// filters such as tojson print keys exactly as the request did, which is
// what Python dicts do in the engines.
func (t *Tokenizer) RenderChatJSON(messages json.RawMessage, opts ChatOptions) (string, error) {
	msgs, err := decodeOrdered(messages)
	if err != nil {
		return "", fmt.Errorf("messages: %w", err)
	}
	return t.renderChatValue(msgs, opts)
}

// renderChatValue renders decoded messages (it rewrites their content
// lists and tool-call arguments in place).
func (t *Tokenizer) renderChatValue(msgs jinja.Value, opts ChatOptions) (string, error) {
	ct := t.chat
	if name := opts.TemplateName; name != "" || (len(opts.Tools) > 0 && t.cfg.ChatTemplates["tool_use"] != "") {
		if name == "" {
			name = "tool_use"
		}
		src, ok := t.cfg.ChatTemplates[name]
		if !ok {
			return "", fmt.Errorf("chat template %q not in tokenizer_config.json", name)
		}
		var err error
		if ct, err = compileChatTemplate(src); err != nil {
			return "", err
		}
	}
	if ct == nil {
		return "", ErrNoChatTemplate
	}
	if !msgs.IsList() {
		return "", fmt.Errorf("messages: want a JSON array")
	}
	sep := opts.PartSeparator
	if sep == "" {
		sep = "\n"
	}
	for i, m := range msgs.AsList().Items {
		if !m.IsDict() {
			return "", fmt.Errorf("messages[%d]: want an object", i)
		}
		d := m.AsDict()
		if !ct.openAIContent {
			if c, ok := d.Get("content"); ok && c.IsList() {
				d.Set("content", jinja.NewString(flattenParts(c.AsList(), sep)))
			}
		}
		if opts.ParseToolArguments {
			if err := parseToolArguments(d); err != nil {
				return "", fmt.Errorf("messages[%d]: %w", i, err)
			}
		}
	}
	ctx := map[string]jinja.Value{
		"messages":              msgs,
		"tools":                 jinja.None(),
		"documents":             jinja.None(),
		"add_generation_prompt": jinja.NewBool(opts.AddGenerationPrompt == nil || *opts.AddGenerationPrompt),
		"bos_token":             tokenValue(t.cfg.BOSToken),
		"eos_token":             tokenValue(t.cfg.EOSToken),
		"unk_token":             tokenValue(t.cfg.UNKToken),
		"pad_token":             tokenValue(t.cfg.PADToken),
	}
	for _, f := range []struct {
		name string
		raw  json.RawMessage
	}{{"tools", opts.Tools}, {"documents", opts.Documents}} {
		if len(f.raw) == 0 || string(f.raw) == "null" {
			continue
		}
		v, err := decodeOrdered(f.raw)
		if err != nil {
			return "", fmt.Errorf("%s: %w", f.name, err)
		}
		ctx[f.name] = v
	}
	if len(opts.Kwargs) > 0 && string(opts.Kwargs) != "null" {
		kw, err := decodeOrdered(opts.Kwargs)
		if err != nil {
			return "", fmt.Errorf("chat_template_kwargs: %w", err)
		}
		if !kw.IsDict() {
			return "", fmt.Errorf("chat_template_kwargs: want a JSON object")
		}
		d := kw.AsDict()
		for _, k := range d.Keys {
			ctx[k] = d.Data[k]
		}
	}
	// Set last so request kwargs cannot shadow it.
	ctx[pyTojsonName] = jinja.NewCallable(pyTojsonName, pyTojson)
	out, err := ct.tmpl.RenderValues(ctx)
	if err != nil {
		return "", fmt.Errorf("render chat_template: %w", err)
	}
	if opts.ContinueFinalMessage {
		out, err = cutAfterFinalMessage(out, msgs.AsList())
		if err != nil {
			return "", err
		}
	}
	return out, nil
}

func tokenValue(s string) jinja.Value {
	if s == "" {
		return jinja.None()
	}
	return jinja.NewString(s)
}

// flattenParts joins the text parts of an OpenAI content list.
func flattenParts(parts *jinja.List, sep string) string {
	var b strings.Builder
	n := 0
	for _, p := range parts.Items {
		if p.IsString() { // a bare string part
			if n > 0 {
				b.WriteString(sep)
			}
			b.WriteString(p.AsString())
			n++
			continue
		}
		if !p.IsDict() {
			continue
		}
		d := p.AsDict()
		typ, _ := d.Get("type")
		if typ.IsString() && typ.AsString() != "text" {
			continue
		}
		if txt, ok := d.Get("text"); ok && txt.IsString() {
			if n > 0 {
				b.WriteString(sep)
			}
			b.WriteString(txt.AsString())
			n++
		}
	}
	return b.String()
}

func parseToolArguments(msg *jinja.Dict) error {
	calls, ok := msg.Get("tool_calls")
	if !ok || !calls.IsList() {
		return nil
	}
	for j, c := range calls.AsList().Items {
		if !c.IsDict() {
			continue
		}
		fn, ok := c.AsDict().Get("function")
		if !ok || !fn.IsDict() {
			continue
		}
		args, ok := fn.AsDict().Get("arguments")
		if !ok || !args.IsString() {
			continue
		}
		v, err := decodeOrdered(json.RawMessage(args.AsString()))
		if err != nil {
			return fmt.Errorf("tool_calls[%d].function.arguments is not valid JSON: %w", j, err)
		}
		fn.AsDict().Set("arguments", v)
	}
	return nil
}

// cutAfterFinalMessage mirrors apply_chat_template(continue_final_message=True):
// the render ends right after the last message's content.
func cutAfterFinalMessage(out string, msgs *jinja.List) (string, error) {
	if msgs.Len() == 0 {
		return out, nil
	}
	last := msgs.Items[msgs.Len()-1]
	var final string
	if last.IsDict() {
		if c, ok := last.AsDict().Get("content"); ok {
			switch {
			case c.IsString():
				final = c.AsString()
			case c.IsList() && c.AsList().Len() > 0:
				if p := c.AsList().Items[c.AsList().Len()-1]; p.IsDict() {
					if txt, ok := p.AsDict().Get("text"); ok && txt.IsString() {
						final = txt.AsString()
					}
				}
			}
		}
	}
	if i := strings.LastIndex(out, final); i >= 0 {
		return out[:i+len(final)], nil
	}
	if s := strings.TrimSpace(final); s != "" {
		if i := strings.LastIndex(out, s); i >= 0 {
			return out[:i+len(s)], nil
		}
	}
	return "", fmt.Errorf("continue_final_message: final message content not found in the render")
}

const maxJSONDepth = 128
