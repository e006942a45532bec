//go:build linux

package vagrant

import (
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/loxilb-llm/loxilb/pkg/dataplane/dataplanetest"
	"github.com/loxilb-llm/loxilb/testbed/daemontest"
)

// TestLabScript runs lab.sh up, check and down as the VM does, on this
// machine, with the built binaries and a lab of its own (LAB_PREFIX), and
// checks that the mode-0 and the mode-4 rule answer from both backends and
// that down leaves no namespace, pin or daemon behind.
func TestLabScript(t *testing.T) {
	dataplanetest.RequirePrivileged(t)
	for _, tool := range []string{"curl", "python3", "nsenter", "unshare"} {
		requireTool(t, tool)
	}
	bins, err := daemontest.Build()
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(bins.Dir)
	prefix := dataplanetest.UniqueName("vl")
	script := filepath.Join(daemontest.RepoRoot(), "testbed/vagrant/lab.sh")
	lab := func(cmd string) (string, error) {
		c := exec.Command("bash", script, cmd)
		c.Env = append(os.Environ(), "LAB_PREFIX="+prefix, "LAB_BIN="+bins.Dir)
		out, err := c.CombinedOutput()
		return string(out), err
	}
	down := func() string {
		out, err := lab("down")
		if err != nil {
			t.Errorf("lab.sh down: %v\n%s", err, out)
		}
		return out
	}
	t.Cleanup(func() {
		if _, err := os.Stat("/run/netns/" + prefix + "-lb"); err == nil {
			down()
		}
	})

	out, err := lab("up")
	if err != nil {
		t.Fatalf("lab.sh up: %v\n%s", err, out)
	}
	out, err = lab("check")
	t.Logf("lab.sh check:\n%s", out)
	if err != nil {
		logs, _ := os.ReadFile("/run/" + prefix + "-loxilb/loxilb.log")
		t.Fatalf("lab.sh check: %v\ndaemon log:\n%s", err, logs)
	}
	for _, want := range []string{
		`mode 0 172\.30\.100\.1: answer \d from be1`, `mode 0 172\.30\.100\.1: answer \d from be2`,
		`mode 0 172\.30\.100\.1: the backends saw the 4 requests come from the client`,
		`mode 4 172\.30\.100\.2: answer \d from be1`, `mode 4 172\.30\.100\.2: answer \d from be2`,
		`mode 4 172\.30\.100\.2: the backends saw the 4 requests come from the proxy`,
	} {
		if !regexp.MustCompile(want).MatchString(out) {
			t.Errorf("check output lacks %q", want)
		}
	}

	out = down()
	if !strings.Contains(out, "removed pin directory /sys/fs/bpf/"+prefix+"-loxilb") {
		t.Errorf("lab.sh down did not clean the pins up:\n%s", out)
	}
	for _, p := range []string{"/run/netns/" + prefix + "-lb", "/run/netns/" + prefix + "-cli", "/sys/fs/bpf/" + prefix + "-loxilb", "/run/" + prefix + "-loxilb"} {
		if _, err := os.Stat(p); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("%s after lab.sh down: %v", p, err)
		}
	}
	// A second down finds nothing and still succeeds.
	if out, err := lab("down"); err != nil {
		t.Errorf("second lab.sh down: %v\n%s", err, out)
	}
}
