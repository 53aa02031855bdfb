package main

import (
	"io"
	"os"
	"strings"
	"testing"

	"github.com/urfave/cli/v2"
)

// TestReferencePageCoversEveryCommand keeps docs/kvctl.md honest as the
// command line grows: every command (group and subcommand) has a heading
// that names it, and every flag and environment variable the app defines
// is mentioned. It checks names, not prose: a new command or flag fails
// here until the page says what it does.
func TestReferencePageCoversEveryCommand(t *testing.T) {
	const page = "../../docs/kvctl.md"
	data, err := os.ReadFile(page)
	if err != nil {
		t.Fatalf("read the reference page: %v", err)
	}
	doc := string(data)
	var headings []string
	for line := range strings.SplitSeq(doc, "\n") {
		if strings.HasPrefix(line, "#") {
			headings = append(headings, line)
		}
	}
	hasHeading := func(s string) bool {
		for _, h := range headings {
			if strings.Contains(h, s) {
				return true
			}
		}
		return false
	}
	checkFlags := func(where string, flags []cli.Flag) {
		for _, f := range flags {
			for _, n := range f.Names() {
				dash := "--" + n
				if len(n) == 1 {
					dash = "-" + n
				}
				if !strings.Contains(doc, "`"+dash) {
					t.Errorf("%s: flag %s is not in %s", where, dash, page)
				}
			}
			if ev, ok := f.(interface{ GetEnvVars() []string }); ok {
				for _, v := range ev.GetEnvVars() {
					if !strings.Contains(doc, v) {
						t.Errorf("%s: environment variable %s is not in %s", where, v, page)
					}
				}
			}
		}
	}

	app := newApp(&env{stdout: io.Discard, stderr: io.Discard})
	checkFlags("kvctl", app.Flags)
	var walk func(path []string, cmds []*cli.Command)
	walk = func(path []string, cmds []*cli.Command) {
		for _, c := range cmds {
			p := append(append([]string{}, path...), c.Name)
			name := "kvctl " + strings.Join(p, " ")
			if !hasHeading(name) {
				t.Errorf("%s has no heading in %s", name, page)
			}
			checkFlags(name, c.Flags)
			walk(p, c.Subcommands)
		}
	}
	walk(nil, app.Commands)
}
