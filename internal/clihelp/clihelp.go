// Package clihelp checks what the binaries' --help shows of their flags,
// and that each flag is read from its environment variable; it reads
// those variables once the command line is parsed (EnvAfterArgs,
// ApplyEnv), so that a flag given outranks its variable, and words the
// binaries' usage errors (UsageError, Want, FromEnv).
//
// urfave/cli appends "(default: VALUE)" to a flag's usage: a flag whose
// usage says its default in words, "(default: from the tokens or
// hashes)", then shows two defaults, the second one the zero value it
// does not mean ("(default: 0)"). Such a flag sets DefaultText to the
// words instead, and its usage leaves them out.
package clihelp

import (
	"fmt"
	"regexp"
	"strings"

	"github.com/urfave/cli/v2"
)

// DoubleDefaults returns, for every flag of app and of its commands at
// any depth whose help line shows "(default:" more than once, the command
// path and that line.
func DoubleDefaults(app *cli.App) []string {
	var bad []string
	check := func(path string, flags []cli.Flag) {
		for _, f := range flags {
			if s := f.String(); strings.Count(s, "(default:") > 1 {
				bad = append(bad, fmt.Sprintf("%s: %s", path, s))
			}
		}
	}
	var walk func(path string, cmds []*cli.Command)
	walk = func(path string, cmds []*cli.Command) {
		for _, c := range cmds {
			p := path + " " + c.Name
			check(p, c.Flags)
			walk(p, c.Subcommands)
		}
	}
	check(app.Name, app.Flags)
	walk(app.Name, app.Commands)
	return bad
}

// EnvVarMismatches returns, for every flag of flags not read from exactly
// one environment variable, PREFIX_ and its name upper-cased with "-" as
// "_" (kvrouter's --raft-addr from KVROUTER_RAFT_ADDR: the design's
// cli.md), a line saying what it reads instead.
func EnvVarMismatches(flags []cli.Flag, prefix string) []string {
	var bad []string
	for _, f := range flags {
		name := f.Names()[0]
		want := prefix + "_" + strings.ToUpper(strings.ReplaceAll(name, "-", "_"))
		df, ok := f.(cli.DocGenerationFlag)
		if !ok {
			bad = append(bad, fmt.Sprintf("--%s: %T has no env vars", name, f))
			continue
		}
		if env := df.GetEnvVars(); len(env) != 1 || env[0] != want {
			bad = append(bad, fmt.Sprintf("--%s: env vars %q, want [%s]", name, env, want))
		}
	}
	return bad
}

// Want says what a flag takes, for a usage error about a value it
// refused: "want a duration with its unit, such as 200ms or 2m". A flag
// wrapped with an Unwrap method is asked through it.
func Want(f cli.Flag) string {
	if u, ok := f.(interface{ Unwrap() cli.Flag }); ok {
		f = u.Unwrap()
	}
	switch f.(type) {
	case *cli.DurationFlag:
		return "want a duration with its unit, such as 200ms or 2m"
	case *cli.Uint64Flag, *cli.UintFlag:
		return "want a whole number, 0 or more"
	case *cli.Int64Flag, *cli.IntFlag:
		return "want a whole number"
	case *cli.Float64Flag:
		return "want a number"
	case *cli.BoolFlag:
		return "want true or false"
	}
	return "want a value as --help describes"
}

// The messages of Go's flag package that urfave/cli passes on, which
// name a flag with one dash and say "parse error" of a value.
var (
	invalidValue = regexp.MustCompile(`^invalid (?:boolean )?value (".*") for (?:flag )?-{1,2}([^ :]+): (.*)$`)
	notDefined   = regexp.MustCompile(`^flag provided but not defined: -{1,2}(.+)$`)
	needsValue   = regexp.MustCompile(`^flag needs an argument: -{1,2}(.+)$`)
)

// UsageError is the one line of a usage error for err, a command line
// that did not parse (a cli.App's OnUsageError): the flag named as the
// operator types it (--flag), what it takes when its value was refused,
// and "; see HELP" (HELP: "kvrouter --help"), instead of the flag
// package's "invalid value "5" for flag -heartbeat-timeout: parse error"
// or "flag provided but not defined: -version". flags are those of the
// command, asked for what a refused flag takes (Want).
func UsageError(err error, flags []cli.Flag, help string) string {
	msg := err.Error()
	switch m := invalidValue.FindStringSubmatch(msg); {
	case m != nil:
		why := "want a value as --help describes"
		for _, f := range flags {
			for _, n := range f.Names() {
				if n == m[2] {
					why = Want(f)
				}
			}
		}
		if m[3] == "value out of range" {
			why = "out of range, " + why
		}
		msg = fmt.Sprintf("--%s %s: %s", m[2], m[1], why)
	case notDefined.MatchString(msg):
		msg = fmt.Sprintf("--%s is not a flag of %s", notDefined.FindStringSubmatch(msg)[1], strings.TrimSuffix(help, " --help"))
	case needsValue.MatchString(msg):
		msg = fmt.Sprintf("--%s needs a value", needsValue.FindStringSubmatch(msg)[1])
	}
	return msg + "; see " + help
}
