package main

import (
	"os"
	"regexp"
	"strconv"
	"strings"
	"testing"

	"github.com/kvrouter/kvrouter/internal/clihelp"
	"github.com/kvrouter/kvrouter/internal/doccheck"
	"github.com/urfave/cli/v2"
)

// TestEveryFlagIsDocumented: every flag kvagent defines is named (`--flag`,
// or in a command line) on some page under docs/, as cmd/kvctl/doc_test.go
// holds kvctl to its reference page: a new flag, or one renamed, failed no
// test while no page said what it does. (internal/doccheck checks the
// other way: every flag the pages name exists.) kvagent has no hidden or
// test-only flag to exempt.
func TestEveryFlagIsDocumented(t *testing.T) {
	doccheck.FlagsDocumented(t, "../../docs", "kvagent", app().Flags)
}

// flagTableRow is a row of a flag table in docs/: "| `--a`, `--b` |
// default | ...", the flags and the default cell.
var flagTableRow = regexp.MustCompile("(?m)^\\| (`--[a-z0-9-]+`(?:, `--[a-z0-9-]+`)*) \\| ([^|]*) \\|")

// tableDefaults reads the flag table rows of the page at path: each flag's
// default as the table writes it, a value in backquotes unquoted, one that
// only describes (in parentheses: "(none)", "(required)", "(off)", or
// "—") as "", and a value followed by a note in parentheses ("0
// (unknown)") as the value.
func tableDefaults(t *testing.T, path string) map[string]string {
	t.Helper()
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]string{}
	for _, m := range flagTableRow.FindAllStringSubmatch(string(data), -1) {
		def := strings.TrimSpace(m[2])
		if strings.HasPrefix(def, "(") || def == "—" {
			def = ""
		}
		if v, _, ok := strings.Cut(def, " ("); ok {
			def = v
		}
		def = strings.Trim(def, "`")
		for _, name := range strings.Split(m[1], ", ") {
			out[strings.Trim(name, "`-")] = def
		}
	}
	return out
}

// checkTableDefaults checks that each of flags is in documented (read by
// tableDefaults from page) with its own default: a flag's zero value
// (0, false) may be written as none.
func checkTableDefaults(t *testing.T, page string, documented map[string]string, flags []cli.Flag) {
	t.Helper()
	for _, f := range flags {
		name := f.Names()[0]
		doc, ok := documented[name]
		if !ok {
			t.Errorf("--%s is not in %s's flag table", name, page)
			continue
		}
		got := strings.Trim(f.(cli.DocGenerationFlag).GetValue(), `"`)
		if e, ok := f.(clihelp.EnvFlag); ok {
			f = e.Unwrap()
		}
		if b, ok := f.(*cli.BoolFlag); ok { // GetValue is "" for a bool
			got = strconv.FormatBool(b.Value)
		}
		if doc == "" && (got == "0" || got == "false") {
			got = ""
		}
		if got != doc {
			t.Errorf("--%s: default %q, %s says %q", name, got, page, doc)
		}
	}
}

// TestOffloadFlagTableDefaultsAreTheFlagsDefaults: docs/offload.md's
// "Flags" table gives each offload flag's default; the flag's own default
// must be that one. (From a review: changing --offload-queue's default
// from 4096 to 16 passed every test of cmd/kvagent.)
func TestOffloadFlagTableDefaultsAreTheFlagsDefaults(t *testing.T) {
	documented := tableDefaults(t, "../../docs/offload.md")
	if len(documented) < 10 {
		t.Fatalf("read %d rows of docs/offload.md's flag table", len(documented))
	}
	checkTableDefaults(t, "docs/offload.md", documented, offloadCLIFlags())
}

// TestFlagTableDefaultsAreTheFlagsDefaults: docs/events.md's table of
// kvagent's flags gives each one's default; the flag's own default must
// be that one, as for the offload flags.
func TestFlagTableDefaultsAreTheFlagsDefaults(t *testing.T) {
	documented := tableDefaults(t, "../../docs/events.md")
	offload := map[string]bool{}
	for _, f := range offloadCLIFlags() {
		offload[f.Names()[0]] = true
	}
	var flags []cli.Flag
	for _, f := range app().Flags {
		if !offload[f.Names()[0]] {
			flags = append(flags, f)
		}
	}
	checkTableDefaults(t, "docs/events.md", documented, flags)
}
