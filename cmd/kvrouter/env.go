package main

import (
	"flag"
	"fmt"
	"os"
	"reflect"

	"github.com/kvrouter/kvrouter/internal/clihelp"
	"github.com/urfave/cli/v2"
)

// envFlag is a flag of kvrouter whose KVROUTER_* variable urfave/cli does
// not read: cli reads a flag's variables as it builds the flag set, before
// the command line, and refuses one that does not parse even when the
// flag is given (docs/operations.md: "a flag given outranks its
// variable"). applyEnv reads them instead, once the command line is
// parsed, for the flags it left unset. The help and the docs still see
// the variables (GetEnvVars).
type envFlag struct{ docFlag }

// docFlag is what cli and the docs' checks ask of a flag.
type docFlag interface {
	cli.DocGenerationFlag
	cli.CategorizableFlag
	cli.RequiredFlag
}

// envAfterArgs makes each of flags an envFlag.
func envAfterArgs(flags []cli.Flag) []cli.Flag {
	out := make([]cli.Flag, len(flags))
	for i, f := range flags {
		out[i] = envFlag{f.(docFlag)}
	}
	return out
}

// Unwrap returns the flag as declared (a *cli.DurationFlag, ...).
func (f envFlag) Unwrap() cli.Flag { return f.docFlag }

// Apply adds the flag to set without reading its variables.
func (f envFlag) Apply(set *flag.FlagSet) error {
	env := reflect.ValueOf(f.docFlag).Elem().FieldByName("EnvVars")
	vars := env.Interface().([]string)
	env.Set(reflect.Zero(env.Type()))
	defer env.Set(reflect.ValueOf(vars))
	return f.docFlag.Apply(set)
}

// applyEnv sets each flag the command line left unset from its variable,
// where that is set: a string flag even to "", as cli did, any other
// flag only to a value (cli skipped an empty one). A value that does not
// parse is a usage error naming the variable.
func applyEnv(c *cli.Context) error {
	for _, f := range c.App.Flags {
		ef, ok := f.(envFlag)
		if !ok {
			continue
		}
		name := ef.Names()[0]
		if c.IsSet(name) {
			continue
		}
		for _, v := range ef.GetEnvVars() {
			val, found := os.LookupEnv(v)
			if !found {
				continue
			}
			if _, isString := ef.docFlag.(*cli.StringFlag); val == "" && !isString {
				break
			}
			if err := c.Set(name, val); err != nil {
				return cli.Exit(fmt.Sprintf("%s=%q (--%s): %s; unset it, or give --%s", v, val, name, clihelp.Want(ef.docFlag), name), 2)
			}
			break
		}
	}
	return nil
}
