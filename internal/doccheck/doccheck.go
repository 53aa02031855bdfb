// Package doccheck holds the pages under docs/ to the module's source.
// Its own tests check what no other package's tests can see whole (the
// metric families every collector registers, the flags the pages name,
// the import rules of docs/architecture.md, the Makefile's pass without
// -race naming every test that -race skips, the API's error reasons in
// docs/api.md's table); FlagsDocumented is for a binary's tests, which
// alone can read its flags, and Reasons for any test that must cover
// every error reason. Only tests import it.
package doccheck

import (
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/urfave/cli/v2"
)

// FlagsDocumented fails t for each of flags (binary bin's) that no page
// under docsDir names whole, in prose or a command line (`--flag`,
// `kvrouter --flag 5`), not as the start of a longer flag: a new flag, or
// one renamed, then fails a test while no page says what it does.
func FlagsDocumented(t testing.TB, docsDir, bin string, flags []cli.Flag) {
	t.Helper()
	docs := pages(t, docsDir)
	if len(flags) == 0 {
		t.Fatalf("%s defines no flag: its flags are no longer where the test reads them", bin)
	}
	for _, f := range flags {
		for _, n := range f.Names() {
			named := regexp.MustCompile("(?:^|[\\s`(\\[])--" + regexp.QuoteMeta(n) + "(?:[^a-z0-9-]|$)")
			if !named.MatchString(docs) {
				t.Errorf("%s flag --%s is named on no page under docs/", bin, n)
			}
		}
	}
}

// pages returns the text of every Markdown page under dir, joined.
func pages(t testing.TB, dir string) string {
	t.Helper()
	var text strings.Builder
	err := filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() || !strings.HasSuffix(p, ".md") {
			return err
		}
		data, err := os.ReadFile(p)
		text.Write(data)
		return err
	})
	if err != nil {
		t.Fatalf("read the pages under %s: %v", dir, err)
	}
	return text.String()
}
