package doccheck

import (
	"go/ast"
	"go/parser"
	"go/token"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
)

// TestDocumentedFlagsExist: every --flag docs/operations.md and
// docs/events.md name (they are the kvrouter and kvagent references) is a
// flag that one of the binaries under cmd/ defines, read from their
// source: a flag renamed or dropped left the pages naming it, with every
// test green (cmd/kvctl/doc_test.go checks only the other way, for kvctl).
// The binaries' tests check that way for kvrouter and kvagent.
func TestDocumentedFlagsExist(t *testing.T) {
	defined := definedFlags(t)
	if !slices.Contains(defined, "node-id") {
		t.Fatalf("kvrouter's --node-id not among the flags read from cmd/ (%d): the reader no longer finds them", len(defined))
	}
	// A name ending in -* stands for the flags it begins (--tls-*).
	flag := regexp.MustCompile("(?:^|[\\s`(\\[])--([a-z][a-z0-9-]*[a-z0-9])(-\\*)?")
	for _, page := range []string{"docs/operations.md", "docs/events.md"} {
		data, err := os.ReadFile(filepath.Join(root, page))
		if err != nil {
			t.Fatalf("read %s: %v", page, err)
		}
		reported := map[string]bool{}
		for _, m := range flag.FindAllStringSubmatch(string(data), -1) {
			name := m[1]
			found := slices.Contains(defined, name)
			if m[2] != "" {
				name += "-*"
				found = slices.ContainsFunc(defined, func(d string) bool { return strings.HasPrefix(d, m[1]+"-") })
			}
			if !found && !reported[name] {
				reported[name] = true
				t.Errorf("%s names --%s, which no binary under cmd/ defines", page, name)
			}
		}
	}
}

// definedFlags returns the names and aliases of the urfave/cli flags the
// non-test Go files under cmd/ define (&cli.StringFlag{Name: "x",
// Aliases: []string{"y"}}), and help, which the library adds.
func definedFlags(t *testing.T) []string {
	t.Helper()
	files, err := filepath.Glob(filepath.Join(root, "cmd", "*", "*.go"))
	if err != nil || len(files) == 0 {
		t.Fatalf("list cmd/*/*.go: %v (%d files)", err, len(files))
	}
	names := []string{"help"}
	lit := func(e ast.Expr) {
		if bl, ok := e.(*ast.BasicLit); ok && bl.Kind == token.STRING {
			if s, err := strconv.Unquote(bl.Value); err == nil {
				names = append(names, s)
			}
		}
	}
	fset := token.NewFileSet()
	for _, p := range files {
		if strings.HasSuffix(p, "_test.go") {
			continue
		}
		f, err := parser.ParseFile(fset, p, nil, 0)
		if err != nil {
			t.Fatalf("parse %s: %v", p, err)
		}
		ast.Inspect(f, func(n ast.Node) bool {
			cl, ok := n.(*ast.CompositeLit)
			if !ok {
				return true
			}
			sel, ok := cl.Type.(*ast.SelectorExpr)
			if !ok || !strings.HasSuffix(sel.Sel.Name, "Flag") {
				return true
			}
			for _, el := range cl.Elts {
				kv, ok := el.(*ast.KeyValueExpr)
				if !ok {
					continue
				}
				switch k, _ := kv.Key.(*ast.Ident); {
				case k == nil:
				case k.Name == "Name":
					lit(kv.Value)
				case k.Name == "Aliases":
					if al, ok := kv.Value.(*ast.CompositeLit); ok {
						for _, a := range al.Elts {
							lit(a)
						}
					}
				}
			}
			return true
		})
	}
	return names
}
