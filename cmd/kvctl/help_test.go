package main

import (
	"bytes"
	"io"
	"strings"
	"testing"

	"github.com/kvrouter/kvrouter/internal/clihelp"
)

// TestNoFlagShowsTwoDefaults: a flag whose usage says its default in
// words shows that default alone in --help. From a review: --isl showed
// "(default: from the tokens or hashes) (default: 0)", --max-time
// "(default: no limit; Ctrl-C stops) (default: 0s)".
func TestNoFlagShowsTwoDefaults(t *testing.T) {
	for _, line := range clihelp.DoubleDefaults(newApp(&env{stdout: io.Discard, stderr: io.Discard})) {
		t.Errorf("two defaults: %s", line)
	}
}

// TestHelpSaysWhatKvctlDoes: the help texts say what the binary does, as
// docs/kvctl.md does. From a review: snapshot save's help promised a
// progress bar where it draws a spinner (the size is not known in
// advance), and route's did not say that commas separate --tokens too.
func TestHelpSaysWhatKvctlDoes(t *testing.T) {
	for _, tc := range []struct {
		args      []string
		want, not string
	}{
		{[]string{"snapshot", "save", "--help"}, "spinner", "progress bar"},
		{[]string{"route", "--help"}, "white space or commas", ""},
	} {
		var out bytes.Buffer
		e := &env{stdout: &out, stderr: &out}
		if code := run(t.Context(), append([]string{"kvctl"}, tc.args...), e); code != 0 {
			t.Fatalf("kvctl %v: exit %d\n%s", tc.args, code, out.String())
		}
		// The help wraps no words, but joins the description's lines.
		help := strings.Join(strings.Fields(out.String()), " ")
		if !strings.Contains(help, tc.want) || (tc.not != "" && strings.Contains(help, tc.not)) {
			t.Errorf("kvctl %v:\n%s\nwant %q in it, and not %q", tc.args, out.String(), tc.want, tc.not)
		}
	}
}

// TestHelpCommandShowsACommandsHelp: kvctl help COMMAND (or its path,
// kvctl help snapshot save) shows the command's help, as kvctl COMMAND
// --help and kvctl snapshot help save do, and help of a command kvctl
// lacks is a usage error (exit 2). From
// a review: kvctl help status was "unknown command", exit 2.
func TestHelpCommandShowsACommandsHelp(t *testing.T) {
	for _, tc := range []struct {
		args []string
		name string
	}{
		{[]string{"help", "status"}, "kvctl status"},
		{[]string{"status", "--help"}, "kvctl status"},
		{[]string{"snapshot", "help", "save"}, "kvctl snapshot save"},
		// By its path: from a review, these showed the group's help, exit
		// 0, dropping the subcommand.
		{[]string{"help", "snapshot", "save"}, "kvctl snapshot save"},
		{[]string{"help", "members", "add"}, "kvctl members add"},
		{[]string{"-o", "json", "help", "snapshot", "restore"}, "kvctl snapshot restore"},
	} {
		r := kvctl(t, tc.args...).wantCode(t, 0)
		if !strings.Contains(r.stdout, tc.name+" - ") || r.stderr != "" {
			t.Errorf("kvctl %v: stdout\n%s\nstderr %q; want %s's help", tc.args, r.stdout, r.stderr, tc.name)
		}
	}
	kvctl(t, "help", "frobnicate").wantCode(t, 2)
	for _, args := range [][]string{{"help", "snapshot", "frobnicate"}, {"help", "snapshot", "save", "extra"},
		{"snapshot", "help", "frobnicate"}} {
		if r := kvctl(t, args...).wantCode(t, 2); !strings.Contains(r.stderr, "has no command") {
			t.Errorf("kvctl %v: stderr %q; want it to say which word names no command", args, r.stderr)
		}
	}
}

// TestHelpOfAnUnknownCommandSaysWhatToDo pins that `kvctl help WORD` for
// a word that names no command fails, exit 2, with one line that says
// what to do (design/cli.md: "Errors go to stderr, one line, saying what
// to do"), as `kvctl WORD` ("kvctl --help lists the commands") and `kvctl
// help snapshot WORD` ("see kvctl snapshot --help") do: not urfave/cli's
// bare "No help topic for 'WORD'".
func TestHelpOfAnUnknownCommandSaysWhatToDo(t *testing.T) {
	r := kvctl(t, "help", "frobnicate").wantCode(t, 2)
	if !strings.Contains(r.stderr, "frobnicate") || !strings.Contains(r.stderr, "kvctl --help") {
		t.Errorf("kvctl help frobnicate: stderr %q; want it to name the word and point to kvctl --help", r.stderr)
	}
}
