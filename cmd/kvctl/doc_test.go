package main

import (
	"encoding/json"
	"io"
	"os"
	"slices"
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

// TestStatusExamplesShowTheColumnsKvctlPrints holds the `$ kvctl ...
// status` tables of docs/kvctl.md to what kvctl prints today for the same
// endpoints: nodes of this build (each reports its NATS connection, as
// every build since the field does) and, where the example shows one, an
// unreachable endpoint. An operator who reads (or scripts against) the
// page's columns must find them in that order: an example taken before a
// column was added (NATS) lists fewer than kvctl prints.
func TestStatusExamplesShowTheColumnsKvctlPrints(t *testing.T) {
	data, err := os.ReadFile("../../docs/kvctl.md")
	if err != nil {
		t.Fatalf("read the reference page: %v", err)
	}
	lines := strings.Split(string(data), "\n")
	examples := 0
	for i, line := range lines {
		if !strings.HasPrefix(line, "$ kvctl ") || !strings.HasSuffix(line, " status") || i+1 >= len(lines) {
			continue
		}
		examples++
		var rows []string
		for _, l := range lines[i+2:] {
			if l == "```" || strings.HasPrefix(l, "kvctl: ") {
				break
			}
			rows = append(rows, l)
		}
		docHeader := strings.Fields(lines[i+1])
		c := newCluster(t)
		for _, n := range c.nodes {
			st := n.fake.Status()
			st.NATS = "connected"
			n.fake.SetStatus(st)
		}
		var eps []string
		for j, row := range rows {
			if strings.Contains(row, "UNREACHABLE") {
				eps = append(eps, deadAddr(t))
			} else {
				eps = append(eps, c.nodes[j%len(c.nodes)].addr())
			}
		}
		r := kvctl(t, "--endpoints", strings.Join(eps, ","), "status")
		got := strings.Fields(strings.SplitN(r.stdout, "\n", 2)[0])
		if !slices.Equal(got, docHeader) {
			t.Errorf("docs/kvctl.md line %d (%s) shows the columns\n  %v\nbut kvctl prints, for the same endpoints,\n  %v",
				i+1, line, docHeader, got)
		}
		// The page's next JSON example is this one's -o json: the keys of
		// its node's status are those kvctl prints.
		j := slices.Index(lines[i:], "```json")
		if j < 0 {
			continue
		}
		var block []string
		for _, l := range lines[i+j+1:] {
			if l == "```" {
				break
			}
			block = append(block, l)
		}
		r = kvctl(t, "--endpoints", strings.Join(eps, ","), "-o", "json", "status")
		docKeys, gotKeys := statusKeys(t, strings.Join(block, "\n")), statusKeys(t, r.stdout)
		if !slices.Equal(docKeys, gotKeys) {
			t.Errorf("docs/kvctl.md line %d: the -o json example of %s gives a node's status the keys\n  %v\nbut kvctl prints\n  %v",
				i+j+1, line, docKeys, gotKeys)
		}
	}
	if examples == 0 {
		t.Fatal("no `$ kvctl ... status` example found in docs/kvctl.md: the test no longer finds them")
	}
}

// statusKeys is the keys, sorted, of the first node status in a kvctl
// status -o json array.
func statusKeys(t *testing.T, text string) []string {
	t.Helper()
	var rows []struct {
		Status map[string]json.RawMessage `json:"status"`
	}
	if err := json.Unmarshal([]byte(text), &rows); err != nil {
		t.Fatalf("kvctl status -o json: %v\n%s", err, text)
	}
	for _, r := range rows {
		if r.Status != nil {
			keys := make([]string, 0, len(r.Status))
			for k := range r.Status {
				keys = append(keys, k)
			}
			slices.Sort(keys)
			return keys
		}
	}
	t.Fatalf("kvctl status -o json: no endpoint with a status\n%s", text)
	return nil
}
