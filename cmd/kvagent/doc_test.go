package main

import (
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

// TestEveryFlagIsDocumented: every flag kvagent defines is named (`--flag`,
// or in a command line) on some page under docs/, as cmd/kvctl/doc_test.go
// holds kvctl to its reference page: a new flag, or one renamed, failed no
// test while no page said what it does. (internal/doccheck checks the
// other way: every flag the pages name exists.) kvagent has no hidden or
// test-only flag to exempt.
func TestEveryFlagIsDocumented(t *testing.T) {
	var docs strings.Builder
	err := filepath.WalkDir("../../docs", func(p string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() || !strings.HasSuffix(p, ".md") {
			return err
		}
		data, err := os.ReadFile(p)
		docs.Write(data)
		return err
	})
	if err != nil {
		t.Fatalf("read the pages under docs/: %v", err)
	}
	flags := app().Flags
	if len(flags) == 0 {
		t.Fatal("kvagent defines no flag: the app's flags are no longer where this test reads them")
	}
	for _, f := range flags {
		for _, n := range f.Names() {
			// The name whole, as a page writes it in prose or a command
			// line (`--flag`, `kvrouter --flag 5`), not the start of a longer one.
			named := regexp.MustCompile("(?:^|[\\s`(\\[])--" + regexp.QuoteMeta(n) + "(?:[^a-z0-9-]|$)")
			if !named.MatchString(docs.String()) {
				t.Errorf("kvagent flag --%s is named on no page under docs/", n)
			}
		}
	}
}
