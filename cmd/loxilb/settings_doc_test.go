package main

import (
	"flag"
	"fmt"
	"os"
	"os/exec"
	"regexp"
	"strings"
	"testing"
)

//go:generate go test -run TestREADMESettings -update .

// docTables are the README's settings tables in README order, each between
// <!-- settings:ID --> and <!-- /settings:ID --> lines. TestREADMESettings
// fails when one differs from the table; `make gen-docs` rewrites them.
var docTables = []string{tabDaemon, tabRouting, tabProxy, tabKV, tabAPI, tabPD}

// renderTable is the Markdown table of the settings listed in table id:
// name, default, accepted values, meaning, and what happens past the bound
// when any row says.
func renderTable(list []*setting, id string) string {
	var rows []*setting
	beyond := false
	for _, s := range list {
		if s.table == id {
			rows = append(rows, s)
			beyond = beyond || s.beyond != ""
		}
	}
	var b strings.Builder
	b.WriteString("| flag / env | default | range | meaning |")
	if beyond {
		b.WriteString(" beyond it |")
	}
	b.WriteString("\n|---|---|---|---|")
	if beyond {
		b.WriteString("---|")
	}
	b.WriteString("\n")
	for _, s := range rows {
		name := "`" + strings.ReplaceAll(s.name(), " / ", "` / `") + "`"
		fmt.Fprintf(&b, "| %s | %s | %s | %s |", name, docDefault(s), s.rng, s.meaning)
		if beyond {
			fmt.Fprintf(&b, " %s |", s.beyond)
		}
		b.WriteString("\n")
	}
	return b.String()
}

// docDefault quotes a text default as code; numbers, durations and the
// words none/unset stay plain.
func docDefault(s *setting) string {
	if _, ok := s.val.(*text); ok && s.def == s.val.String() && s.def != "" {
		return "`" + s.def + "`"
	}
	return s.def
}

// replaceBlock returns doc with the block of table id replaced by body, and
// whether the block was found.
func replaceBlock(doc, id, body string) (string, bool) {
	open, end := "<!-- settings:"+id+" -->\n", "<!-- /settings:"+id+" -->"
	i := strings.Index(doc, open)
	if i < 0 {
		return doc, false
	}
	j := strings.Index(doc[i:], end)
	if j < 0 {
		return doc, false
	}
	return doc[:i+len(open)] + body + doc[i+j:], true
}

// envName matches the daemon's environment variable names in text (git
// grep -E syntax: no \b).
var envName = regexp.MustCompile(`(LLB|LOXILB)_[A-Z0-9_]*[A-Z0-9]`)

var update = flag.Bool("update", false, "rewrite the README's settings tables from the settings table")

// TestREADMESettings: the README's settings tables are the settings table
// rendered; run with -update (or `make gen-docs`) after changing a row.
func TestREADMESettings(t *testing.T) {
	const path = "../../README.md"
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	c := &config{}
	list := c.settings()
	if err := load(flag.NewFlagSet("doc", flag.ContinueOnError), list, nil, noEnv); err != nil {
		t.Fatal(err)
	}
	doc, listed := string(b), map[string]bool{}
	for _, id := range docTables {
		got, ok := replaceBlock(doc, id, renderTable(list, id))
		if !ok {
			t.Fatalf("README.md has no <!-- settings:%s --> ... <!-- /settings:%s --> block", id, id)
		}
		if got != doc && !*update {
			t.Errorf("README.md's %s settings table differs from cmd/loxilb/settings_table.go: run make gen-docs", id)
		}
		doc = got
		listed[id] = true
	}
	for _, s := range list {
		if !listed[s.table] {
			t.Errorf("%s is in table %q, which the README does not show", s.name(), s.table)
		}
	}
	if *update && doc != string(b) {
		if err := os.WriteFile(path, []byte(doc), 0o644); err != nil {
			t.Fatal(err)
		}
	}
}

// notDaemonSettings are environment names of tests, benchmarks and the lab,
// which the daemon does not read.
var notDaemonSettings = regexp.MustCompile(`^(LOXILB_(BENCH|LAB|HA_LAB|PROXY_BENCH)_?.*|LOXILB_ETCD_BIN|LOXILB_TEST_NETNS_CHILD)$`)

// TestEveryNamedSettingExists: every LLB_* or LOXILB_* name the code or the
// documentation mentions is a row of the settings table, so no document
// points at a variable the daemon does not read.
func TestEveryNamedSettingExists(t *testing.T) {
	known := map[string]bool{}
	for _, s := range (&config{}).settings() {
		known[s.env] = true
	}
	out, err := exec.Command("git", "-C", "../..", "grep", "-noE", envName.String(), "--", "*.go", "*.md", "*.sh", "Makefile", "Vagrantfile").Output()
	if err != nil {
		if os.Getenv("CI") != "" {
			t.Fatalf("git grep: %v (CI runs on a git checkout)", err)
		}
		t.Skipf("git grep: %v", err) // not a git checkout
	}
	for _, line := range strings.Split(strings.TrimSpace(string(out)), "\n") {
		where, name, _ := strings.Cut(line[strings.Index(line, ":")+1:], ":")
		file := line[:strings.Index(line, ":")]
		if !known[name] && !family(known, name) && !notDaemonSettings.MatchString(name) {
			t.Errorf("%s:%s names %s, which is not in cmd/loxilb/settings_table.go", file, where, name)
		}
	}
}

// family reports whether name is the common prefix of known names, as in
// "LLB_PD_*".
func family(known map[string]bool, name string) bool {
	for k := range known {
		if strings.HasPrefix(k, name+"_") {
			return true
		}
	}
	return false
}
