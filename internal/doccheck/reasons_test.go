package doccheck

import (
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
)

// TestEveryReasonIsInTheDocsErrorTable pins the reasons of api/errors.go
// (each Reason* constant, with the status its comment gives) against the
// "Errors" table of docs/api.md, both ways. From a review: a reason added
// in the code only (or dropped from the table) passed every test.
func TestEveryReasonIsInTheDocsErrorTable(t *testing.T) {
	code := Reasons(t, filepath.Join(root, "api"))
	doc, err := os.ReadFile(filepath.Join(root, "docs", "api.md"))
	if err != nil {
		t.Fatal(err)
	}
	_, sec, _ := strings.Cut(string(doc), "\n## Errors\n")
	sec, _, _ = strings.Cut(sec, "\n## ")
	documented := map[string]string{}
	rowRe := regexp.MustCompile(`(?m)^\| (\d{3}) \| ([^|]*) \|`)
	reasonRe := regexp.MustCompile("`([a-z_]+)`")
	for _, m := range rowRe.FindAllStringSubmatch(sec, -1) {
		for _, r := range reasonRe.FindAllStringSubmatch(m[2], -1) {
			documented[r[1]] = m[1]
		}
	}
	if len(documented) == 0 {
		t.Fatalf("found no reason in docs/api.md's error table: the table is no longer where the test reads it")
	}
	var keys []string
	for k := range code {
		keys = append(keys, k)
	}
	for k := range documented {
		if _, ok := code[k]; !ok {
			keys = append(keys, k)
		}
	}
	slices.Sort(keys)
	for _, k := range keys {
		c, inCode := code[k]
		d, inDoc := documented[k]
		switch {
		case !inDoc:
			t.Errorf("reason %q (api/errors.go) is not in docs/api.md's error table", k)
		case !inCode:
			t.Errorf("reason %q of docs/api.md's error table is no Reason constant of api/errors.go", k)
		case c != "" && c != d:
			t.Errorf("reason %q: api/errors.go says %s, docs/api.md %s", k, c, d)
		}
	}
}
