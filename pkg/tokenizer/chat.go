package tokenizer

import "github.com/ardanlabs/jinja"

type chatTemplate struct{ tmpl *jinja.Template }

func compileChatTemplate(src string) (*chatTemplate, error) {
	t, err := jinja.Compile(src)
	if err != nil {
		return nil, err
	}
	return &chatTemplate{tmpl: t}, nil
}
