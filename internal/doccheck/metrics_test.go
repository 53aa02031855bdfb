package doccheck

import (
	"go/ast"
	"go/parser"
	"go/token"
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
)

// root is the module's root, from this package's directory.
const root = "../.."

// TestDocumentedMetricFamiliesExist: every metric family (kvrouter_*,
// kvagent_*) that a page under docs/ or README.md names is a string some
// non-test Go file of the module holds, whole or after the binary's prefix
// (the collectors build names with helpers: d("index_worker_blocks") is
// kvrouter_index_worker_blocks), or split between a helper's prefix and a
// name. No other test reads operations.md's "What to watch": a family
// renamed or dropped in the code left the page naming it, and every test
// green.
func TestDocumentedMetricFamiliesExist(t *testing.T) {
	lits := sourceStrings(t)
	var pages []string
	err := filepath.WalkDir(filepath.Join(root, "docs"), func(p string, d fs.DirEntry, err error) error {
		if err == nil && !d.IsDir() && strings.HasSuffix(p, ".md") {
			pages = append(pages, p)
		}
		return err
	})
	if err != nil {
		t.Fatalf("list the pages under docs/: %v", err)
	}
	pages = append(pages, filepath.Join(root, "README.md"))
	name := regexp.MustCompile("`((?:kvrouter|kvagent)_[a-z0-9_]*[a-z0-9])(?:\\{[^`]*\\})?`")
	checked := 0
	for _, p := range pages {
		data, err := os.ReadFile(p)
		if err != nil {
			t.Fatalf("read %s: %v", p, err)
		}
		for _, m := range name.FindAllStringSubmatch(string(data), -1) {
			n := m[1]
			if strings.HasSuffix(n, "_join_addr") { // a stable-store key, not a metric
				continue
			}
			checked++
			if !registered(lits, n) {
				t.Errorf("%s names metric %s, which no Go file registers", p, n)
			}
		}
	}
	// A pattern that stopped matching the pages would pass on nothing.
	if checked == 0 {
		t.Fatal("no metric family found in the pages: the pattern no longer matches them")
	}
}

// registered reports whether the metric family n is a source string,
// whole, after its binary's prefix, or as a helper's prefix ending in "_"
// followed by another source string.
func registered(lits map[string]bool, n string) bool {
	prefix, rest, _ := strings.Cut(n, "_")
	if lits[n] || lits[rest] {
		return true
	}
	for l := range lits {
		if strings.HasPrefix(l, prefix+"_") && strings.HasSuffix(l, "_") && strings.HasPrefix(n, l) && lits[n[len(l):]] {
			return true
		}
	}
	return false
}

// sourceStrings returns every string literal of the module's non-test Go
// files (hidden directories and testdata left out).
func sourceStrings(t *testing.T) map[string]bool {
	t.Helper()
	lits := map[string]bool{}
	fset := token.NewFileSet()
	err := filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() {
			if p != root && (strings.HasPrefix(d.Name(), ".") || d.Name() == "testdata") {
				return filepath.SkipDir
			}
			return nil
		}
		if !strings.HasSuffix(p, ".go") || strings.HasSuffix(p, "_test.go") {
			return nil
		}
		f, err := parser.ParseFile(fset, p, nil, 0)
		if err != nil {
			return err
		}
		ast.Inspect(f, func(n ast.Node) bool {
			if bl, ok := n.(*ast.BasicLit); ok && bl.Kind == token.STRING {
				if s, err := strconv.Unquote(bl.Value); err == nil {
					lits[s] = true
				}
			}
			return true
		})
		return nil
	})
	if err != nil {
		t.Fatalf("read the module's Go source: %v", err)
	}
	return lits
}
