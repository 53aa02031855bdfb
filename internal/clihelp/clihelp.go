// Package clihelp checks what the binaries' --help shows of their flags.
//
// urfave/cli appends "(default: VALUE)" to a flag's usage: a flag whose
// usage says its default in words, "(default: from the tokens or
// hashes)", then shows two defaults, the second one the zero value it
// does not mean ("(default: 0)"). Such a flag sets DefaultText to the
// words instead, and its usage leaves them out.
package clihelp

import (
	"fmt"
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
