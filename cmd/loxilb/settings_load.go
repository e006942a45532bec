package main

import (
	"flag"
	"fmt"
	"strings"
)

// A setting is one row of the daemon's settings table (settings_table.go):
// the flag and environment variable that set it, its default, the values it
// accepts and what it means. The same row registers the flag, reads the
// environment, checks the range, names the source of a bad value and
// renders the README's settings tables, so the four cannot disagree.
type setting struct {
	flag string // flag name without dashes; "" when only the environment sets it
	env  string // environment variable; "" when only the flag sets it
	// def and rng are the default and the accepted values as documented;
	// empty means the value's own rendering (set by load).
	def, rng string
	meaning  string // what the setting does; the README cell and the flag's usage
	beyond   string // what happens past the bound (limit tables only)
	table    string // the README table listing it (see docTables)
	val      value
	// from is where the value came from after load: "flag", "env" or ""
	// (the default); raw is the environment text.
	from, raw string
}

// load sets every setting from its environment variable (unset or empty
// keeps the default), then from the command line, which wins, and checks
// the range of every value that was given. An error names the flag or the
// variable and what it accepts, so a typo never falls back to a default.
func load(fs *flag.FlagSet, list []*setting, args []string, env func(string) (string, bool)) error {
	for _, s := range list {
		if s.def == "" {
			s.def = defaultText(s.val)
		}
		if s.rng == "" {
			s.rng = s.val.span()
		}
	}
	for _, s := range list {
		if s.env == "" {
			continue
		}
		v, ok := env(s.env)
		if !ok || v == "" {
			continue
		}
		if err := s.val.Set(v); err != nil {
			return fmt.Errorf("%s=%q: %w", s.env, v, err)
		}
		s.from, s.raw = "env", v
	}
	for _, s := range list {
		if s.flag != "" {
			fs.Var(s.val, s.flag, s.usage())
		}
	}
	if err := fs.Parse(args); err != nil {
		return err
	}
	given := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { given[f.Name] = true })
	for _, s := range list {
		if given[s.flag] {
			s.from = "flag"
		}
		if s.from == "" {
			continue // a default
		}
		if err := s.val.check(); err != nil {
			return s.wrong(err)
		}
	}
	return nil
}

// wrong names the source of a bad value.
func (s *setting) wrong(err error) error {
	if s.from == "env" {
		return fmt.Errorf("%s=%q: %w", s.env, s.raw, err)
	}
	return fmt.Errorf("--%s %s: %w", s.flag, s.val, err)
}

// name is how the documentation refers to the setting.
func (s *setting) name() string {
	switch {
	case s.flag == "":
		return s.env
	case s.env == "":
		return "--" + s.flag
	}
	return "--" + s.flag + " / " + s.env
}

// usage is the flag's help text: the meaning, the range and the variable.
func (s *setting) usage() string {
	var extra []string
	if s.rng != "" {
		extra = append(extra, s.rng)
	}
	if s.env != "" {
		extra = append(extra, "env "+s.env)
	}
	u := strings.ReplaceAll(s.meaning, "`", "")
	if len(extra) > 0 {
		u += " (" + strings.Join(extra, "; ") + ")"
	}
	return u
}

// defaultText renders a default for people: sizes in KiB/MiB/GiB, off/on,
// none for an empty text.
func defaultText(v value) string {
	switch v := v.(type) {
	case *number[int]:
		if v.unit == "bytes" {
			return sizeText(int64(*v.p))
		}
	case *number[int64]:
		if v.unit == "bytes" {
			return sizeText(*v.p)
		}
	case *boolean:
		if *v.p {
			return "on"
		}
		return "off"
	case *text:
		if *v.p == "" {
			return "none"
		}
	}
	return v.String()
}

func sizeText(n int64) string {
	for _, u := range []struct {
		div  int64
		name string
	}{{1 << 40, "TiB"}, {1 << 30, "GiB"}, {1 << 20, "MiB"}, {1 << 10, "KiB"}} {
		if n >= u.div && n%u.div == 0 {
			return fmt.Sprintf("%d %s", n/u.div, u.name)
		}
	}
	return fmt.Sprint(n)
}
