package main

import (
	"errors"
	"fmt"
	"os"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/internal/clihelp"
	"github.com/kvrouter/kvrouter/internal/doccheck"
	"github.com/urfave/cli/v2"
)

// TestEveryFlagIsDocumented: every flag kvrouter defines is named (`--flag`,
// or in a command line) on some page under docs/, as cmd/kvctl/doc_test.go
// holds kvctl to its reference page: a new flag, or one renamed, failed no
// test while no page said what it does. (internal/doccheck checks the
// other way: every flag the pages name exists.) kvrouter has no hidden or
// test-only flag to exempt.
func TestEveryFlagIsDocumented(t *testing.T) {
	doccheck.FlagsDocumented(t, "../../docs", "kvrouter", newApp().Flags)
}

// TestTimeoutsParagraphNamesTheZerosAndNegativesTaken holds
// docs/operations.md ("Timeouts": zero or negative durations and sizes are
// refused with exit 2, but for the ones it names) to the flags: every
// duration or size flag given 0, and given a negative value, is refused
// with exit 2 naming it unless the paragraph names that value as taken
// (`--flag 0`, negative `--flag`), and every value it names as taken is.
// The paragraph said every such value was refused, while
// --leader-lease-timeout 0, a negative --snapshot-bytes and
// --max-snapshot-bytes 0 were taken on purpose. A value is taken when
// kvrouter goes on to its next check, an empty --node-id, which refuses
// it before anything starts. The KVROUTER_* variables the flags read are
// cleared: one set where the tests run (KVROUTER_SNAPSHOT_BYTES=0) was
// refused before --node-id's check, for every flag tried.
func TestTimeoutsParagraphNamesTheZerosAndNegativesTaken(t *testing.T) {
	clearFlagEnv(t)
	data, err := os.ReadFile("../../docs/operations.md")
	if err != nil {
		t.Fatalf("read docs/operations.md: %v", err)
	}
	_, para, ok := strings.Cut(string(data), "\nTimeouts: ")
	if !ok {
		t.Fatal(`docs/operations.md has no paragraph starting "Timeouts: "`)
	}
	para, _, _ = strings.Cut(para, "\n\n")
	para = strings.Join(strings.Fields(para), " ") // one line: a name may wrap
	checked := 0
	for _, f := range newApp().Flags {
		var zero, negative string
		switch f.(clihelp.EnvFlag).Unwrap().(type) {
		case *cli.DurationFlag:
			zero, negative = "0s", "-1s"
		case *cli.Int64Flag, *cli.IntFlag:
			zero, negative = "0", "-1"
		case *cli.Uint64Flag:
			zero = "0" // a negative value does not parse
		default:
			continue
		}
		name := f.Names()[0]
		for _, v := range []struct{ value, doc string }{
			{zero, "`--" + name + " 0`"},
			{negative, "negative `--" + name + "`"},
		} {
			if v.value == "" {
				continue
			}
			checked++
			err := runKvrouterFor(t, 10*time.Second, "--data-dir", t.TempDir(), "--node-id", "", "--"+name, v.value)
			var ec cli.ExitCoder
			if !errors.As(err, &ec) || ec.ExitCode() != 2 {
				t.Fatalf("kvrouter --%s %s with an empty --node-id: %v, want exit 2", name, v.value, err)
			}
			taken := strings.Contains(err.Error(), "--node-id is empty")
			switch documented := strings.Contains(para, v.doc); {
			case taken && !documented:
				t.Errorf("kvrouter takes --%s %s, but operations.md's Timeouts paragraph does not name it (%s) among the values taken", name, v.value, v.doc)
			case !taken && documented:
				t.Errorf("operations.md's Timeouts paragraph names %s as taken, but kvrouter refuses it: %v", v.doc, err)
			case !taken && !strings.Contains(err.Error(), "--"+name):
				t.Errorf("kvrouter --%s %s: %v, want the refusal to name --%s", name, v.value, err, name)
			}
		}
	}
	if checked == 0 {
		t.Fatal("kvrouter has no duration or size flag: the test no longer finds them")
	}
}

// clearFlagEnv unsets, for the test, the environment variables kvrouter's
// flags read (KVROUTER_*), so that a run sees only the test's arguments,
// not the environment the tests happen to run in.
func clearFlagEnv(t *testing.T) {
	t.Helper()
	clihelp.UnsetEnv(t, newApp().Flags)
}

// TestHelpExamplesJoinTheirNodesNATSServers holds the command lines of
// kvrouter --help (its Description's Examples) to docs/events.md: "the
// nodes' servers form one NATS cluster through --nats-cluster-addr and
// --nats-routes, so an agent may connect to any node". An example node
// of a cluster of several (one started with --peers naming others, or
// with --join) gives both, as docs/operations.md's bootstrap and join
// examples do; and it gives its own --nats-addr, since the default
// (127.0.0.1:4222) is, on the example's loopback layout, where the
// bootstrap example's pattern (n1 at 4221, routes 6222 and 6223) puts n2.
// The n4 --join example gave neither: copied beside the three nodes it
// exits 1 ("nats server on 127.0.0.1:4222: ... address already in use"),
// and on a free port it runs an embedded server no agent's events reach
// while it leads.
func TestHelpExamplesJoinTheirNodesNATSServers(t *testing.T) {
	desc := newApp().Description
	var cmds []string
	for _, line := range strings.Split(desc, "\n") {
		line = strings.TrimSpace(line)
		if i := strings.Index(line, "#"); i >= 0 {
			line = strings.TrimSpace(line[:i])
		}
		if strings.HasPrefix(line, "kvrouter") {
			cmds = append(cmds, line)
		} else if len(cmds) > 0 && line != "" && !strings.HasSuffix(line, ":") {
			cmds[len(cmds)-1] += " " + line
		}
	}
	checked := 0
	for _, cmd := range cmds {
		cmd = strings.ReplaceAll(cmd, "\\ ", " ")
		args := strings.Fields(cmd)
		multi := false
		for i, a := range args {
			if a == "--join" || (a == "--peers" && i+1 < len(args) && strings.Contains(args[i+1], ",")) {
				multi = true
			}
		}
		if !multi {
			continue
		}
		checked++
		for _, flag := range []string{"--nats-addr", "--nats-cluster-addr", "--nats-routes"} {
			if !slices.Contains(args, flag) {
				t.Errorf("kvrouter --help example %q starts a node of a cluster of several without %s", cmd, flag)
			}
		}
	}
	if checked == 0 {
		t.Fatalf("no example of a cluster's node found in kvrouter's Description:\n%s", desc)
	}
}

// TestTheDefaultsTheDocsWriteInProseAreTheFlags: the defaults that
// docs/operations.md and docs/events.md write in their prose are the
// flags' own, as the kvagent flag tables are held to theirs: a changed
// default failed no test while the pages still gave the old one. Each
// phrase is matched with the page's line breaks read as spaces.
func TestTheDefaultsTheDocsWriteInProseAreTheFlags(t *testing.T) {
	defaults := map[string]time.Duration{}
	for _, f := range newApp().Flags {
		if e, ok := f.(clihelp.EnvFlag); ok {
			f = e.Unwrap()
		}
		if d, ok := f.(*cli.DurationFlag); ok {
			defaults[d.Name] = d.Value
		}
	}
	for _, c := range []struct {
		page, flag, phrase string // phrase: the default in %d units
		unit               time.Duration
	}{
		{"operations.md", "heartbeat-timeout", "`--heartbeat-timeout` and `--election-timeout` default to %d ms", time.Millisecond},
		{"operations.md", "election-timeout", "`--heartbeat-timeout` and `--election-timeout` default to %d ms", time.Millisecond},
		{"operations.md", "booking-max-age", "(`KVROUTER_BOOKING_MAX_AGE`; default %d s,", time.Second},
		{"events.md", "unregistered-grace", "`--unregistered-grace` (default %d min,", time.Minute},
		{"events.md", "silent-after", "`--silent-after` (default %d min)", time.Minute},
	} {
		data, err := os.ReadFile("../../docs/" + c.page)
		if err != nil {
			t.Fatal(err)
		}
		d, ok := defaults[c.flag]
		if !ok {
			t.Errorf("no duration flag --%s", c.flag)
			continue
		}
		want := fmt.Sprintf(c.phrase, d/c.unit)
		if d%c.unit != 0 || !strings.Contains(strings.Join(strings.Fields(string(data)), " "), want) {
			t.Errorf("--%s: default %v, and docs/%s does not say %q", c.flag, d, c.page, want)
		}
	}
}
