package layering

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"go/ast"
	"go/parser"
	"go/token"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"testing"
)

const mod = "github.com/loxilb-llm/loxilb"

// pkgInfo is what `go list -json` says of one package of the module.
type pkgInfo struct {
	ImportPath   string
	Dir          string
	GoFiles      []string // non-test Go files of the build
	Imports      []string // direct imports of the non-test files
	Deps         []string // transitive imports of the non-test files
	TestImports  []string // direct imports of the in-package test files
	XTestImports []string // direct imports of the _test package files
}

// rule forbids packages matching from to import packages matching to.
// Transitive rules look at everything the package's non-test files pull in,
// so a forbidden edge cannot hide behind an intermediate package. Test files
// are always checked by their direct imports. testExceptions lists
// (importer, imported) pairs that only test files may have, each with a
// reason in ARCHITECTURE.md.
type rule struct {
	name           string
	from           func(string) bool
	to             func(string) bool
	transitive     bool
	testExceptions [][2]string
}

// under reports whether p is path or below it.
func under(path string) func(string) bool {
	return func(p string) bool { return p == path || strings.HasPrefix(p, path+"/") }
}

func not(f func(string) bool) func(string) bool { return func(p string) bool { return !f(p) } }

func anyOf(fs ...func(string) bool) func(string) bool {
	return func(p string) bool {
		for _, f := range fs {
			if f(p) {
				return true
			}
		}
		return false
	}
}

// rules are the layering of ARCHITECTURE.md; keep the two in step.
var rules = []rule{
	{
		name: "cilium/ebpf is imported only by pkg/dataplane/ebpf",
		from: not(under(mod + "/pkg/dataplane/ebpf")),
		to:   under("github.com/cilium/ebpf"),
		testExceptions: [][2]string{
			{mod + "/pkg/control", "github.com/cilium/ebpf"}, // the kernel reconcile benchmark reads the pinned conntrack map
			{mod + "/testbed/netns", "github.com/cilium/ebpf"},
			{mod + "/testbed/netns", "github.com/cilium/ebpf/link"},
			{mod + "/testbed/netns", "github.com/cilium/ebpf/asm"}, // the empty TC program measured as the floor under tc_lb's run time
		},
	},
	{
		name: "gin is imported only by api",
		from: not(under(mod + "/api")),
		to:   under("github.com/gin-gonic/gin"),
	},
	{
		name:       "pkg never imports api, cmd, loxicmd or testbed",
		from:       under(mod + "/pkg"),
		to:         anyOf(under(mod+"/api"), under(mod+"/cmd"), under(mod+"/loxicmd"), under(mod+"/testbed")),
		transitive: true,
		testExceptions: [][2]string{
			{mod + "/pkg/dispatch", mod + "/testbed/enginesim"}, // engines emulated on their true wire formats
			{mod + "/pkg/gateway", mod + "/testbed/enginesim"},
			{mod + "/pkg/gateway", mod + "/testbed/pki"}, // a throw-away CA for the TLS tests
			{mod + "/pkg/reconcilers", mod + "/testbed/pki"},
			{mod + "/pkg/proxy", mod + "/testbed/pki"},
			{mod + "/pkg/dispatch", mod + "/testbed/wait"}, // the shared Eventually
			{mod + "/pkg/enginemetrics", mod + "/testbed/wait"},
			{mod + "/pkg/proxy", mod + "/testbed/wait"},
			{mod + "/pkg/peerprefill", mod + "/testbed/wait"},
			{mod + "/pkg/rawio", mod + "/testbed/wait"},
			{mod + "/pkg/gcfloor", mod + "/testbed/wait"},
		},
	},
	{
		name:       "pkg/proxy never imports pkg/gateway or pkg/router",
		from:       under(mod + "/pkg/proxy"),
		to:         anyOf(under(mod+"/pkg/gateway"), under(mod+"/pkg/router")),
		transitive: true,
	},
	{
		name:       "pkg/gateway never imports pkg/enginemetrics",
		from:       under(mod + "/pkg/gateway"),
		to:         under(mod + "/pkg/enginemetrics"),
		transitive: true,
	},
	{
		name:       "pkg/control never imports pkg/gateway or pkg/proxy",
		from:       under(mod + "/pkg/control"),
		to:         anyOf(under(mod+"/pkg/gateway"), under(mod+"/pkg/proxy")),
		transitive: true,
	},
}

// violations returns one line per forbidden import in pkgs, sorted.
func violations(pkgs []pkgInfo, rules []rule) []string {
	var out []string
	for _, p := range pkgs {
		for _, r := range rules {
			if !r.from(p.ImportPath) {
				continue
			}
			prod, how := p.Imports, "imports"
			if r.transitive {
				prod, how = p.Deps, "depends on"
			}
			for _, imp := range prod {
				if r.to(imp) {
					out = append(out, fmt.Sprintf("%s %s %s (%s)", p.ImportPath, how, imp, r.name))
				}
			}
			for _, imp := range slices.Concat(p.TestImports, p.XTestImports) {
				if r.to(imp) && !slices.Contains(r.testExceptions, [2]string{p.ImportPath, imp}) {
					out = append(out, fmt.Sprintf("%s tests import %s (%s)", p.ImportPath, imp, r.name))
				}
			}
		}
	}
	slices.Sort(out)
	return slices.Compact(out)
}

// listModule runs `go list -json` over the whole module. The go command is
// the one that runs this test, so the answer matches the build.
func listModule(t *testing.T) []pkgInfo {
	t.Helper()
	gobin := filepath.Join(runtime.GOROOT(), "bin", "go")
	if _, err := exec.LookPath(gobin); err != nil {
		if gobin, err = exec.LookPath("go"); err != nil {
			t.Fatalf("the go command is needed to list the module's imports: %v", err)
		}
	}
	cmd := exec.Command(gobin, "list", "-e", "-json=ImportPath,Dir,GoFiles,Imports,Deps,TestImports,XTestImports,Error", mod+"/...")
	cmd.Dir = ".." // inside the module; the pattern names the whole of it
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("go list: %v\n%s", err, stderr.String())
	}
	var pkgs []pkgInfo
	dec := json.NewDecoder(bytes.NewReader(out))
	for {
		var p pkgInfo
		if err := dec.Decode(&p); errors.Is(err, io.EOF) {
			break
		} else if err != nil {
			t.Fatalf("decoding go list output: %v", err)
		}
		pkgs = append(pkgs, p)
	}
	if len(pkgs) < 10 {
		t.Fatalf("go list found %d packages in %s; expected the whole module", len(pkgs), mod)
	}
	return pkgs
}

// requestPath are the packages a mode-4 request passes through on its way
// to an endpoint. Only pkg/proxy talks to endpoints (its upstream: pooled
// connections, TLS settings, error classes, in-flight counts); these
// packages build no net/http client or transport of their own, and P/D
// legs take the proxy's (proxy.Request.Legs).
var requestPath = []string{mod + "/pkg/dispatch", mod + "/pkg/gateway", mod + "/pkg/router", mod + "/pkg/selector"}

// clientExceptions are files of requestPath packages that may build an
// HTTP client because they are not on the request path, each with its
// reason. None is needed: side inputs that poll endpoints (the engines'
// metrics scraper, pkg/enginemetrics; health probes) live in packages of
// their own, off the request path.
var clientExceptions = map[string]string{}

// httpClientNames are the net/http names that send requests.
var httpClientNames = []string{"Transport", "Client", "DefaultTransport", "DefaultClient"}

// httpClientUses returns "file:line: http.Name" for every use of an
// httpClientNames name in src (one Go file).
func httpClientUses(name string, src []byte) ([]string, error) {
	fset := token.NewFileSet()
	f, err := parser.ParseFile(fset, name, src, parser.SkipObjectResolution)
	if err != nil {
		return nil, err
	}
	local := ""
	for _, im := range f.Imports {
		if im.Path.Value == `"net/http"` {
			local = "http"
			if im.Name != nil {
				local = im.Name.Name
			}
		}
	}
	if local == "" {
		return nil, nil
	}
	var out []string
	ast.Inspect(f, func(n ast.Node) bool {
		sel, ok := n.(*ast.SelectorExpr)
		if !ok {
			return true
		}
		if id, ok := sel.X.(*ast.Ident); ok && id.Name == local && slices.Contains(httpClientNames, sel.Sel.Name) {
			out = append(out, fmt.Sprintf("%s:%d: http.%s", name, fset.Position(sel.Pos()).Line, sel.Sel.Name))
		}
		return true
	})
	return out, nil
}

// TestOnlyProxyTalksToEndpoints: no package of the request path but
// pkg/proxy builds an HTTP client or transport.
func TestOnlyProxyTalksToEndpoints(t *testing.T) {
	checked := 0
	for _, p := range listModule(t) {
		if !slices.Contains(requestPath, p.ImportPath) {
			continue
		}
		for _, f := range p.GoFiles {
			if _, ok := clientExceptions[p.ImportPath+"/"+f]; ok {
				continue
			}
			src, err := os.ReadFile(filepath.Join(p.Dir, f))
			if err != nil {
				t.Fatal(err)
			}
			uses, err := httpClientUses(p.ImportPath+"/"+f, src)
			if err != nil {
				t.Fatal(err)
			}
			for _, u := range uses {
				t.Errorf("%s: the request path sends to endpoints only through pkg/proxy's upstream", u)
			}
			checked++
		}
	}
	if checked == 0 {
		t.Fatal("no file of the request path was checked")
	}
	for f := range clientExceptions {
		if _, err := os.Stat(filepath.Join("..", "..", strings.TrimPrefix(f, mod+"/"))); err != nil {
			t.Errorf("exception %s no longer exists; remove it", f)
		}
	}
}

// TestHTTPClientUses: the scanner sees a transport built under any import
// name, and not a name that only looks alike.
func TestHTTPClientUses(t *testing.T) {
	src := `package x
import (
	nethttp "net/http"
	other "example.com/http"
)
var a = &nethttp.Transport{}
var b = nethttp.DefaultClient
var c = other.Transport{}
var d = nethttp.Header{}
`
	got, err := httpClientUses("x.go", []byte(src))
	if err != nil {
		t.Fatal(err)
	}
	want := []string{"x.go:6: http.Transport", "x.go:7: http.DefaultClient"}
	if !slices.Equal(got, want) {
		t.Fatalf("got %q, want %q", got, want)
	}
}

func TestLayering(t *testing.T) {
	pkgs := listModule(t)
	for _, v := range violations(pkgs, rules) {
		t.Error(v)
	}
	// Every exception must still be needed, so the list cannot outgrow the tree.
	for _, r := range rules {
		for _, ex := range r.testExceptions {
			used := false
			for _, p := range pkgs {
				if p.ImportPath == ex[0] && slices.Contains(slices.Concat(p.TestImports, p.XTestImports), ex[1]) {
					used = true
				}
			}
			if !used {
				t.Errorf("exception %s → %s of %q is no longer used; remove it", ex[0], ex[1], r.name)
			}
		}
	}
}

// TestViolationsCatchesForbiddenImports feeds the checker a tree with one
// forbidden import per rule, so a rule that stops matching fails here.
func TestViolationsCatchesForbiddenImports(t *testing.T) {
	pkgs := []pkgInfo{
		{ImportPath: mod + "/pkg/router", Imports: []string{"github.com/cilium/ebpf"}},
		{ImportPath: mod + "/pkg/health", Imports: []string{"github.com/gin-gonic/gin/binding"}},
		{ImportPath: mod + "/pkg/kvindex", Deps: []string{mod + "/api/client"}},
		{ImportPath: mod + "/pkg/tokenizer", XTestImports: []string{mod + "/loxicmd"}},
		{ImportPath: mod + "/pkg/proxy/inner", Deps: []string{mod + "/pkg/router"}},
		{ImportPath: mod + "/pkg/control", Deps: []string{mod + "/pkg/proxy"}},
		{ImportPath: mod + "/pkg/gateway", Deps: []string{mod + "/pkg/enginemetrics"}},
		// Allowed: the data plane, api, and a listed test exception.
		{ImportPath: mod + "/pkg/dataplane/ebpf", Imports: []string{"github.com/cilium/ebpf/link"}},
		{ImportPath: mod + "/api", Imports: []string{"github.com/gin-gonic/gin"}},
		{ImportPath: mod + "/pkg/gateway", TestImports: []string{mod + "/testbed/enginesim"}},
	}
	got := violations(pkgs, rules)
	want := []string{
		mod + "/pkg/control depends on " + mod + "/pkg/proxy",
		mod + "/pkg/gateway depends on " + mod + "/pkg/enginemetrics",
		mod + "/pkg/health imports github.com/gin-gonic/gin/binding",
		mod + "/pkg/kvindex depends on " + mod + "/api/client",
		mod + "/pkg/proxy/inner depends on " + mod + "/pkg/router",
		mod + "/pkg/router imports github.com/cilium/ebpf",
		mod + "/pkg/tokenizer tests import " + mod + "/loxicmd",
	}
	if len(got) != len(want) {
		t.Fatalf("got %d violations, want %d:\n%s", len(got), len(want), strings.Join(got, "\n"))
	}
	for i := range want {
		if !strings.HasPrefix(got[i], want[i]+" (") {
			t.Errorf("violation %d = %q, want %q (…)", i, got[i], want[i])
		}
	}
}
