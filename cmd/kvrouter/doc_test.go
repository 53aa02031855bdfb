package main

import (
	"errors"
	"os"
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
