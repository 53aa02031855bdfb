package doccheck

import (
	"go/ast"
	"go/parser"
	"go/token"
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
)

// TestEveryRaceSkippedTestRunsWithoutRace: a test that reads its
// package's raceEnabled constant (allocation and memory checks, skipped or
// weakened under -race) runs in make test's second pass, without -race:
// its name matches the Makefile's NORACE_RUN and its package is in
// NORACE_PKGS. Four such tests had names the pass's -run did not match,
// and ran in no CI run at all; nothing said so.
func TestEveryRaceSkippedTestRunsWithoutRace(t *testing.T) {
	makefile, err := os.ReadFile(filepath.Join(root, "Makefile"))
	if err != nil {
		t.Fatal(err)
	}
	run := makeVar(t, makefile, "NORACE_RUN")
	pkgs := strings.Fields(makeVar(t, makefile, "NORACE_PKGS"))
	runRE, err := regexp.Compile(run)
	if err != nil {
		t.Fatalf("NORACE_RUN %q: %v", run, err)
	}
	if !strings.Contains(string(makefile), "-run '$(NORACE_RUN)' $(NORACE_PKGS)") {
		t.Fatal("the Makefile runs no `go test -run '$(NORACE_RUN)' $(NORACE_PKGS)`: the race-skipped tests run nowhere")
	}

	found := 0
	err = filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() {
			if name := d.Name(); p != root && (strings.HasPrefix(name, ".") || name == "testdata" || name == "bin" || name == "data") {
				return filepath.SkipDir
			}
			return nil
		}
		if !strings.HasSuffix(p, "_test.go") {
			return nil
		}
		f, err := parser.ParseFile(token.NewFileSet(), p, nil, parser.SkipObjectResolution)
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(root, p)
		dir := filepath.Dir(rel)
		for _, decl := range f.Decls {
			fn, ok := decl.(*ast.FuncDecl)
			if !ok || fn.Body == nil || !readsRaceEnabled(fn.Body) {
				continue
			}
			name := fn.Name.Name
			if !strings.HasPrefix(name, "Test") {
				t.Errorf("%s: %s reads raceEnabled; only a Test function should, so that the second pass can name it", rel, name)
				continue
			}
			found++
			if !runRE.MatchString(name) {
				t.Errorf("%s: %s reads raceEnabled and does not match NORACE_RUN %q: it runs in no pass without -race", rel, name, run)
			}
			if !coveredBy(dir, pkgs) {
				t.Errorf("%s: %s reads raceEnabled and its package ./%s/ is not in NORACE_PKGS %q", rel, name, dir, pkgs)
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if found == 0 {
		t.Fatal("no test reads raceEnabled: the check no longer finds them")
	}
	t.Logf("%d tests read raceEnabled; each runs without -race", found)
}

// makeVar is the value of the Makefile's `name = value` line.
func makeVar(t *testing.T, makefile []byte, name string) string {
	t.Helper()
	m := regexp.MustCompile(`(?m)^` + name + `\s*:?=\s*(.*)$`).FindSubmatch(makefile)
	if m == nil {
		t.Fatalf("the Makefile sets no %s", name)
	}
	return strings.TrimSpace(string(m[1]))
}

// readsRaceEnabled reports whether body names the identifier raceEnabled.
func readsRaceEnabled(body *ast.BlockStmt) bool {
	found := false
	ast.Inspect(body, func(n ast.Node) bool {
		if id, ok := n.(*ast.Ident); ok && id.Name == "raceEnabled" {
			found = true
		}
		return !found
	})
	return found
}

// coveredBy reports whether package directory dir is one of go test's
// package patterns pkgs (./dir/ or ./dir/... for dir and those under it).
func coveredBy(dir string, pkgs []string) bool {
	dir = filepath.ToSlash(dir)
	return slices.ContainsFunc(pkgs, func(p string) bool {
		p = strings.TrimPrefix(p, "./")
		if base, ok := strings.CutSuffix(p, "/..."); ok {
			return dir == base || strings.HasPrefix(dir, base+"/")
		}
		return dir == strings.TrimSuffix(p, "/")
	})
}
