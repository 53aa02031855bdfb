package doccheck

import (
	"bytes"
	"context"
	"fmt"
	"os/exec"
	"slices"
	"strings"
	"testing"
	"time"
)

const module = "github.com/kvrouter/kvrouter/"

// layers are docs/architecture.md's direction ("Dependencies point one
// way: cmd → services → raftfsm/offload → store/indexer → kvevent"),
// lowest first: a package of a layer imports none of a higher layer's.
// Packages not listed here are services (layer 3), but internal/ (helpers
// beside every layer) and cmd/ (main packages, which nothing can import).
var layers = []struct {
	layer    int
	prefixes []string // a package, or (ending in "/") every package under it
}{
	{0, []string{"kvevent", "kvevent/"}},
	{1, []string{"store", "indexer"}},
	{2, []string{"raftfsm", "offload/"}},
}

// mustNotImport are the table's "import X" rules: the package (and its
// dependencies, which would carry the import in) must not import these
// paths or any package under them.
var mustNotImport = map[string][]string{
	"indexer":         {"github.com/hashicorp/raft", "github.com/cockroachdb/pebble", "github.com/nats-io"},
	"offload/backend": {"github.com/hashicorp/raft"},
	"offload/nvml":    {"github.com/hashicorp/raft"},
	"raftfsm":         {module + "kvevent/engine"}, // parse engine wire formats
	"store":           {module + "indexer"},        // know about routing
}

// mustNotImportDirectly are the table's rules on a package's own imports
// only: eventplane must not touch the index directly, and reaches it
// through raftfsm's node (which imports indexer, so its dependencies do).
var mustNotImportDirectly = map[string][]string{
	"eventplane": {module + "indexer"},
}

// testOnly are the packages the table says must not be imported outside
// tests and benchmarks; testSupport the non-test packages that exist only
// for tests and benchmarks, which may import them.
var (
	testOnly    = []string{"internal/benchenv", "internal/pypub", "internal/wirepack", "internal/testwatch", "internal/netproxy"}
	testSupport = []string{"api/apitest", "offload/pool/pooltest", "benchcluster", "e2e"}
)

// TestArchitectureImportRules holds the module's non-test packages to
// docs/architecture.md's import rules (section 3): the layers' direction,
// each "must not import", sim not imported by the router, and the test
// helpers not imported outside tests. No other test read them: an import
// against them built and passed. A failure names the package, what it
// must not import and its own import that brings it in.
func TestArchitectureImportRules(t *testing.T) {
	gotool, err := exec.LookPath("go")
	if err != nil {
		t.Skipf("no go tool to list the packages' imports: %v", err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, gotool, "list", "-deps", "-f", "{{.ImportPath}}|{{join .Imports \" \"}}|{{join .Deps \" \"}}", "./...")
	cmd.Dir = root
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		// A go tool that cannot resolve the module's requirements (no
		// module cache, and no network or GOPROXY=off) lists nothing: that
		// is the machine's, not the imports', and skipped. Any other
		// failure (an import of no package, a cycle) is the code's.
		if reason := unresolvable(ctx, gotool); reason != "" {
			t.Skipf("go list -deps ./... failed (%v), and the go tool cannot resolve the module's requirements here: %s", err, reason)
		}
		t.Fatalf("go list -deps ./...: %v\n%s", err, stderr.String())
	}
	imports, deps := map[string][]string{}, map[string][]string{}
	var pkgs []string // the module's packages, without the module's path
	for line := range strings.SplitSeq(strings.TrimSpace(string(out)), "\n") {
		parts := strings.Split(line, "|")
		if len(parts) != 3 {
			t.Fatalf("go list: unexpected line %q", line)
		}
		imports[parts[0]], deps[parts[0]] = strings.Fields(parts[1]), strings.Fields(parts[2])
		if rel, ok := strings.CutPrefix(parts[0], module); ok {
			pkgs = append(pkgs, rel)
		}
	}
	if !slices.Contains(pkgs, "indexer") || !slices.Contains(pkgs, "raftfsm") {
		t.Fatalf("go list found none of indexer, raftfsm in %v: run from the wrong directory?", pkgs)
	}
	// via names pkg's own import that is, or depends on, dep.
	via := func(pkg, dep string) string {
		for _, i := range imports[module+pkg] {
			if i == dep || slices.Contains(deps[i], dep) {
				return i
			}
		}
		return "?"
	}
	// check reports the dependencies of pkg that forbidden matches, one
	// for each of pkg's imports that brings them in (a module such as
	// Pebble brings dozens of its packages with it).
	check := func(pkg, rule string, forbidden func(dep string) bool) {
		seen := map[string]bool{}
		for _, d := range deps[module+pkg] {
			if v := via(pkg, d); forbidden(d) && !seen[v] {
				seen[v] = true
				t.Errorf("%s depends on %s (through its import of %s): docs/architecture.md, %s", pkg, d, v, rule)
			}
		}
	}
	under := func(path, prefix string) bool { return path == prefix || strings.HasPrefix(path, prefix+"/") }

	layerOf := func(pkg string) int {
		if strings.HasPrefix(pkg, "internal/") || strings.HasPrefix(pkg, "cmd/") {
			return -1
		}
		for _, l := range layers {
			for _, p := range l.prefixes {
				if pkg == p || (strings.HasSuffix(p, "/") && strings.HasPrefix(pkg, p)) {
					return l.layer
				}
			}
		}
		return 3
	}
	for _, pkg := range pkgs {
		if l := layerOf(pkg); l >= 0 {
			check(pkg, "dependencies point one way (cmd → services → raftfsm/offload → store/indexer → kvevent)", func(d string) bool {
				rel, ok := strings.CutPrefix(d, module)
				return ok && layerOf(rel) > l
			})
		}
	}
	for pkg, paths := range mustNotImport {
		check(pkg, pkg+" must not import "+strings.Join(paths, ", "), func(d string) bool {
			return slices.ContainsFunc(paths, func(p string) bool { return under(d, p) })
		})
	}
	for pkg, paths := range mustNotImportDirectly {
		for _, i := range imports[module+pkg] {
			if slices.ContainsFunc(paths, func(p string) bool { return under(i, p) }) {
				t.Errorf("%s imports %s: docs/architecture.md, %s must not import %s itself", pkg, i, pkg, strings.Join(paths, ", "))
			}
		}
	}
	check("cmd/kvrouter", "sim must not be imported by the router", func(d string) bool { return under(d, module+"sim") })
	for _, pkg := range pkgs {
		if slices.Contains(testOnly, pkg) || slices.Contains(testSupport, pkg) {
			continue
		}
		check(pkg, "must not be imported outside tests and benchmarks", func(d string) bool {
			rel, ok := strings.CutPrefix(d, module)
			return ok && slices.Contains(testOnly, rel)
		})
	}
}

// unresolvable returns why the go tool cannot resolve the module's
// requirements (go list -m all fails: no module cache to read them from,
// and none to fetch them), or "" when it can.
func unresolvable(ctx context.Context, gotool string) string {
	cmd := exec.CommandContext(ctx, gotool, "list", "-m", "all")
	cmd.Dir = root
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	if err := cmd.Run(); err != nil {
		return fmt.Sprintf("go list -m all: %v: %s", err, strings.TrimSpace(stderr.String()))
	}
	return ""
}
