package doccheck

import (
	"go/ast"
	"go/parser"
	"go/token"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
)

// Reasons returns the error reasons api/errors.go declares (each Reason*
// constant's value) in the api package at apiDir, each with the status
// its line's comment starts with ("" when it gives none). The reasons are
// read from the source: Go cannot list a package's constants, and a
// reason added there must reach every table that is to cover them all
// (docs/api.md's, kvctl's hints) without anyone remembering them.
func Reasons(t testing.TB, apiDir string) map[string]string {
	t.Helper()
	f, err := parser.ParseFile(token.NewFileSet(), filepath.Join(apiDir, "errors.go"), nil, parser.ParseComments)
	if err != nil {
		t.Fatalf("read the api package's reasons: %v", err)
	}
	status := regexp.MustCompile(`^\s*(\d{3})`)
	out := map[string]string{}
	for _, d := range f.Decls {
		g, ok := d.(*ast.GenDecl)
		if !ok || g.Tok != token.CONST {
			continue
		}
		for _, s := range g.Specs {
			vs, ok := s.(*ast.ValueSpec)
			if !ok || len(vs.Names) != 1 || !strings.HasPrefix(vs.Names[0].Name, "Reason") || len(vs.Values) != 1 {
				continue
			}
			lit, ok := vs.Values[0].(*ast.BasicLit)
			if !ok || lit.Kind != token.STRING {
				continue
			}
			v, err := strconv.Unquote(lit.Value)
			if err != nil {
				t.Fatalf("%s: %v", vs.Names[0].Name, err)
			}
			st := ""
			if vs.Comment != nil {
				if m := status.FindStringSubmatch(vs.Comment.Text()); m != nil {
					st = m[1]
				}
			}
			out[v] = st
		}
	}
	if len(out) == 0 {
		t.Fatalf("no Reason constant in %s: the reasons are no longer where Reasons reads them", filepath.Join(apiDir, "errors.go"))
	}
	return out
}
