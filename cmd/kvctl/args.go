package main

import (
	"strings"

	"github.com/urfave/cli/v2"
)

// hoistFlags reorders a command line so that urfave/cli v2 sees every flag.
// Like Go's flag package it stops reading flags at the first positional
// argument, which would make `kvctl snapshot restore FILE --data-dir DIR`
// treat "--data-dir" as an argument, and it reads global flags only before
// the command, which would refuse `kvctl status -o json`. So: the flags of
// the command that follow its arguments move in front of them, and global
// flags that follow the command move in front of it. A value is carried
// with its flag; "--" ends the flags as usual; a flag nobody defines stays
// with the command, whose parser then reports it.
func hoistFlags(app *cli.App, args []string) ([]string, error) {
	if len(args) < 2 {
		return args, nil
	}
	globals := flagTable(app.Flags)
	rest := args[1:]
	out := []string{args[0]}

	// Global flags before the command stay where they are.
	i := 0
	for i < len(rest) && isFlag(rest[i]) && rest[i] != "--" {
		n := flagLen(globals, rest, i)
		out = append(out, rest[i:i+n]...)
		i += n
	}

	// The command path: names of nested commands.
	var path []string
	var leaf *cli.Command
	cmds := app.Commands
	for i < len(rest) {
		c := findCommand(cmds, rest[i])
		if c == nil {
			break
		}
		path, leaf, cmds = append(path, rest[i]), c, c.Subcommands
		i++
	}
	if leaf == nil {
		return args, nil // no command: leave it to the parser to complain
	}
	local := flagTable(append([]cli.Flag{cli.HelpFlag}, leaf.Flags...))

	var moved, flags, positional []string
	for j := i; j < len(rest); {
		a := rest[j]
		if a == "--" {
			positional = append(positional, rest[j:]...)
			break
		}
		if !isFlag(a) {
			positional = append(positional, a)
			j++
			continue
		}
		name := flagName(a)
		_, isLocal := local[name]
		if takes := local[name] || (!isLocal && globals[name]); takes && !strings.Contains(a, "=") && j+1 == len(rest) {
			// Moved in front of the arguments, it would take one of them
			// as its value.
			return nil, usagef("flag %s needs a value; see %s --help", a, strings.Join(append([]string{"kvctl"}, path...), " "))
		}
		if _, ok := local[name]; ok {
			n := flagLen(local, rest, j)
			flags = append(flags, rest[j:j+n]...)
			j += n
		} else if _, ok := globals[name]; ok {
			n := flagLen(globals, rest, j)
			moved = append(moved, rest[j:j+n]...)
			j += n
		} else {
			flags = append(flags, a)
			j++
		}
	}
	out = append(out, moved...)
	out = append(out, path...)
	out = append(out, flags...)
	return append(out, positional...), nil
}

// flagTable maps every name of every flag to whether it takes a value.
func flagTable(flags []cli.Flag) map[string]bool {
	t := map[string]bool{}
	for _, f := range flags {
		takes := true
		if d, ok := f.(cli.DocGenerationFlag); ok {
			takes = d.TakesValue()
		}
		for _, n := range f.Names() {
			t[n] = takes
		}
	}
	return t
}

// helpPath turns `kvctl help CMD SUB...` into `kvctl CMD SUB... --help`:
// urfave/cli's help command shows the help of its first word alone, and
// `kvctl help snapshot save` showed the snapshot group's, exit 0, dropping
// save. A word that names no command where it stands is a usage error. A
// single word (`kvctl help status`) is left to the help command.
func helpPath(app *cli.App, args []string) ([]string, error) {
	if len(args) < 2 {
		return args, nil
	}
	globals := flagTable(app.Flags)
	rest := args[1:]
	i := 0
	for i < len(rest) && isFlag(rest[i]) && rest[i] != "--" {
		i += flagLen(globals, rest, i)
	}
	if i >= len(rest) || rest[i] != "help" && rest[i] != "h" {
		return args, nil
	}
	words := rest[i+1:]
	n := 0 // the words of the path: up to the first flag
	for n < len(words) && !isFlag(words[n]) {
		n++
	}
	if n < 2 {
		return args, nil
	}
	path := []string{"kvctl"}
	cmds := app.Commands
	for _, w := range words[:n] {
		c := findCommand(cmds, w)
		if c == nil {
			where := strings.Join(path, " ")
			return nil, usagef("kvctl help: %s has no command %q; see %s --help", where, w, where)
		}
		path, cmds = append(path, c.Name), c.Subcommands
	}
	out := append([]string{}, args[:1+i]...)
	out = append(out, words[:n]...)
	out = append(out, "--help")
	return append(out, words[n:]...), nil
}

func findCommand(cmds []*cli.Command, name string) *cli.Command {
	for _, c := range cmds {
		if c.HasName(name) {
			return c
		}
	}
	return nil
}

func isFlag(a string) bool { return len(a) > 1 && a[0] == '-' }

func flagName(a string) string {
	name := strings.TrimLeft(a, "-")
	if k := strings.IndexByte(name, '='); k >= 0 {
		name = name[:k]
	}
	return name
}

// flagLen is how many arguments the flag at args[i] spans: 2 when it takes
// a value given as the next argument, else 1.
func flagLen(table map[string]bool, args []string, i int) int {
	a := args[i]
	if takes := table[flagName(a)]; takes && !strings.Contains(a, "=") && i+1 < len(args) {
		return 2
	}
	return 1
}
