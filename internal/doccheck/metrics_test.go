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
	"strconv"
	"strings"
	"testing"
)

// root is the module's root, from this package's directory.
const root = "../.."

// TestDocumentedMetricFamiliesExist: every metric family (kvrouter_*,
// kvagent_*) that a page under docs/ or README.md names is one some
// non-test Go file of the module registers: a name given to
// prometheus.NewDesc, an Opts' Name (after its Namespace and Subsystem),
// or a helper's prefix and the name a call of it gives (the collectors
// build names with helpers: d("index_worker_blocks") is
// kvrouter_index_worker_blocks). No other test reads operations.md's
// "What to watch": a family renamed or dropped in the code left the page
// naming it, and every test green. Not any string literal: a metric's
// name after the prefix is often a word the code holds for another use
// ("ready", a JSON tag), and a family renamed passed on it.
func TestDocumentedMetricFamiliesExist(t *testing.T) {
	names := metricNames(t)
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
			if !names[n] {
				t.Errorf("%s names metric %s, which no Go file registers", p, n)
			}
		}
	}
	// A pattern that stopped matching the pages would pass on nothing.
	if checked == 0 {
		t.Fatal("no metric family found in the pages: the pattern no longer matches them")
	}
}

// TestRegisteredMetricFamiliesAreDocumented: every metric family a
// non-test Go file registers is named on a page under docs/ or in
// README.md, by its name or under a family prefix a page names with a
// star (`kvagent_events_*`, as operations.md's "What to watch" lists the
// agents'). The check above reads the other way only: a family added to
// the code with no word in the docs passed every test, and an operator
// reading the pages never learnt of it.
func TestRegisteredMetricFamiliesAreDocumented(t *testing.T) {
	names := metricNames(t)
	if len(names) == 0 {
		t.Fatal("no metric family found in the Go source: the parser no longer finds them")
	}
	readme, err := os.ReadFile(filepath.Join(root, "README.md"))
	if err != nil {
		t.Fatalf("read README.md: %v", err)
	}
	text := pages(t, filepath.Join(root, "docs")) + string(readme)
	named := regexp.MustCompile(`\b(?:kvrouter|kvagent)_[a-z0-9_]*[a-z0-9]\b`)
	documented := map[string]bool{}
	for _, n := range named.FindAllString(text, -1) {
		documented[n] = true
	}
	var prefixes []string
	for _, m := range regexp.MustCompile("`((?:kvrouter|kvagent)_[a-z0-9_]*_)\\*`").FindAllStringSubmatch(text, -1) {
		prefixes = append(prefixes, m[1])
	}
	for n := range names {
		if documented[n] || slices.ContainsFunc(prefixes, func(p string) bool { return strings.HasPrefix(n, p) }) {
			continue
		}
		t.Errorf("metric %s is registered in the code and named on no page under docs/ (nor under a documented prefix_*)", n)
	}
}

// TestDashboardMetricFamiliesExist: every metric the Grafana dashboards
// under docs/grafana/ query is a family some Go file registers (a
// histogram's _bucket, _sum and _count series its family's). The pages'
// check reads Markdown only: a family renamed left a dashboard panel
// empty, with every test green.
func TestDashboardMetricFamiliesExist(t *testing.T) {
	names := metricNames(t)
	dashboards, err := filepath.Glob(filepath.Join(root, "docs", "grafana", "*.json"))
	if err != nil || len(dashboards) == 0 {
		t.Fatalf("no dashboard under docs/grafana/ (%v): the check reads nothing", err)
	}
	name := regexp.MustCompile(`\b(?:kvrouter|kvagent)_[a-z0-9_]*[a-z0-9]\b`)
	checked := 0
	for _, p := range dashboards {
		data, err := os.ReadFile(p)
		if err != nil {
			t.Fatalf("read %s: %v", p, err)
		}
		for _, n := range name.FindAllString(string(data), -1) {
			checked++
			family := n
			for _, suffix := range []string{"_bucket", "_sum", "_count"} {
				if base, ok := strings.CutSuffix(n, suffix); ok && !names[n] && names[base] {
					family = base
				}
			}
			if !names[family] {
				t.Errorf("%s queries metric %s, which no Go file registers", filepath.Base(p), n)
			}
		}
	}
	if checked == 0 {
		t.Fatal("no metric found in the dashboards: the pattern no longer matches them")
	}
}

// metricNames returns the metric families the module's non-test Go files
// (hidden directories and testdata left out) register by name: the string
// literal given to prometheus.NewDesc, or an Opts' Name, Namespace and
// Subsystem joined by "_"; and, for a helper of the file that gives
// NewDesc or an Opts' Name its first parameter, or a literal prefix and it
// (d := func(name, ...) { return prometheus.NewDesc("kvrouter_"+name, ...) }),
// the prefix and the literal of each of the file's calls of it.
func metricNames(t *testing.T) map[string]bool {
	t.Helper()
	names := map[string]bool{}
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
		fileMetricNames(f, names)
		return nil
	})
	if err != nil {
		t.Fatalf("read the module's Go source: %v", err)
	}
	return names
}

// fileMetricNames adds to names the metric families f registers by name
// (metricNames).
func fileMetricNames(f *ast.File, names map[string]bool) {
	helpers := map[string][]string{} // a helper's name → its prefixes
	// The helpers first: a function, or a function literal assigned to a
	// name, that gives NewDesc or an Opts' Name its first parameter, or a
	// literal prefix + it.
	helper := func(name string, ft *ast.FuncType, body *ast.BlockStmt) {
		if body == nil || ft.Params == nil || len(ft.Params.List) == 0 || len(ft.Params.List[0].Names) == 0 {
			return
		}
		param := ft.Params.List[0].Names[0].Name
		prefixOf := func(e ast.Expr) {
			if id, ok := e.(*ast.Ident); ok && id.Name == param {
				helpers[name] = append(helpers[name], "")
			}
			if be, ok := e.(*ast.BinaryExpr); ok && be.Op == token.ADD {
				if id, ok := be.Y.(*ast.Ident); ok && id.Name == param {
					if prefix, ok := stringLit(be.X); ok {
						helpers[name] = append(helpers[name], prefix)
					}
				}
			}
		}
		ast.Inspect(body, func(n ast.Node) bool {
			switch n := n.(type) {
			case *ast.CallExpr:
				if isCallOf(n, "NewDesc") && len(n.Args) > 0 {
					prefixOf(n.Args[0])
				}
			case *ast.KeyValueExpr:
				if key, ok := n.Key.(*ast.Ident); ok && key.Name == "Name" {
					prefixOf(n.Value)
				}
			}
			return true
		})
	}
	ast.Inspect(f, func(n ast.Node) bool {
		switch n := n.(type) {
		case *ast.FuncDecl:
			helper(n.Name.Name, n.Type, n.Body)
		case *ast.AssignStmt:
			for i, rhs := range n.Rhs {
				if fl, ok := rhs.(*ast.FuncLit); ok && i < len(n.Lhs) {
					if id, ok := n.Lhs[i].(*ast.Ident); ok {
						helper(id.Name, fl.Type, fl.Body)
					}
				}
			}
		}
		return true
	})
	ast.Inspect(f, func(n ast.Node) bool {
		switch n := n.(type) {
		case *ast.CallExpr:
			if len(n.Args) == 0 {
				return true
			}
			lit, ok := stringLit(n.Args[0])
			if !ok {
				return true
			}
			if isCallOf(n, "NewDesc") {
				names[lit] = true
			}
			if id, ok := n.Fun.(*ast.Ident); ok {
				for _, prefix := range helpers[id.Name] {
					names[prefix+lit] = true
				}
			}
		case *ast.CompositeLit:
			sel, ok := n.Type.(*ast.SelectorExpr)
			if !ok || !strings.HasSuffix(sel.Sel.Name, "Opts") {
				return true
			}
			var parts [3]string // Namespace, Subsystem, Name
			for _, e := range n.Elts {
				kv, ok := e.(*ast.KeyValueExpr)
				if !ok {
					continue
				}
				key, ok := kv.Key.(*ast.Ident)
				if !ok {
					continue
				}
				v, ok := stringLit(kv.Value)
				if !ok {
					continue
				}
				switch key.Name {
				case "Namespace":
					parts[0] = v
				case "Subsystem":
					parts[1] = v
				case "Name":
					parts[2] = v
				}
			}
			if parts[2] != "" {
				// As prometheus.BuildFQName joins them: the empty ones left out.
				var nonEmpty []string
				for _, s := range parts {
					if s != "" {
						nonEmpty = append(nonEmpty, s)
					}
				}
				names[strings.Join(nonEmpty, "_")] = true
			}
		}
		return true
	})
}

// isCallOf reports whether call calls a function named fn of another
// package (prometheus.NewDesc).
func isCallOf(call *ast.CallExpr, fn string) bool {
	sel, ok := call.Fun.(*ast.SelectorExpr)
	return ok && sel.Sel.Name == fn
}

// stringLit returns the value of e when it is a string literal.
func stringLit(e ast.Expr) (string, bool) {
	bl, ok := e.(*ast.BasicLit)
	if !ok || bl.Kind != token.STRING {
		return "", false
	}
	s, err := strconv.Unquote(bl.Value)
	return s, err == nil
}
