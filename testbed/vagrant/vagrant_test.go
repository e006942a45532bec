package vagrant

import (
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"testing"

	"github.com/loxilb-llm/loxilb/testbed/daemontest"
)

// requireTool skips outside CI when a tool is missing; in CI (which installs
// it) a missing tool fails the test.
func requireTool(t *testing.T, name string) {
	t.Helper()
	if _, err := exec.LookPath(name); err != nil {
		if os.Getenv("CI") == "true" {
			t.Fatalf("%s is required in CI (.ci/run installs it)", name)
		}
		t.Skipf("skipping: %s not installed (CI installs it)", name)
	}
}

// TestVagrantfileSyntax parses the Vagrantfile with Ruby and checks every
// script it calls exists.
func TestVagrantfileSyntax(t *testing.T) {
	requireTool(t, "ruby")
	root := daemontest.RepoRoot()
	vf := filepath.Join(root, "Vagrantfile")
	if out, err := exec.Command("ruby", "-c", vf).CombinedOutput(); err != nil {
		t.Fatalf("ruby -c Vagrantfile: %v\n%s", err, out)
	}
	src, err := os.ReadFile(vf)
	if err != nil {
		t.Fatal(err)
	}
	scripts := regexp.MustCompile(`/vagrant/(testbed/[A-Za-z0-9_/.-]+\.sh)`).FindAllSubmatch(src, -1)
	if len(scripts) < 3 {
		t.Fatalf("the Vagrantfile calls %d scripts, want provision.sh, lab.sh and run.sh", len(scripts))
	}
	for _, m := range scripts {
		if _, err := os.Stat(filepath.Join(root, string(m[1]))); err != nil {
			t.Errorf("the Vagrantfile calls %s: %v", m[1], err)
		}
	}
}

// TestScriptsSyntax parses the lab scripts with the shell they run under.
func TestScriptsSyntax(t *testing.T) {
	requireTool(t, "bash")
	root := daemontest.RepoRoot()
	for _, s := range []struct{ shell, path string }{
		{"bash", "testbed/vagrant/provision.sh"},
		{"bash", "testbed/vagrant/lab.sh"},
		{"sh", "testbed/netns/lab.sh"},
		{"sh", "testbed/netns/run.sh"},
	} {
		if out, err := exec.Command(s.shell, "-n", filepath.Join(root, s.path)).CombinedOutput(); err != nil {
			t.Errorf("%s -n %s: %v\n%s", s.shell, s.path, err, out)
		}
	}
}
