package clihelp

import (
	"errors"
	"flag"
	"fmt"
	"os"
	"reflect"
	"strings"

	"github.com/urfave/cli/v2"
)

// EnvFlag is a flag whose variables (PREFIX_NAME) urfave/cli does not
// read: cli reads a flag's variables as it builds the flag set, before
// the command line, and refuses one that does not parse even when the
// flag is given (docs/operations.md: "a flag given outranks its
// variable"). ApplyEnv, a command's Before, reads them instead, once the
// command line is parsed, for the flags it left unset. The help and the
// docs still see the variables (GetEnvVars).
type EnvFlag struct{ docFlag }

// docFlag is what cli and the docs' checks ask of a flag.
type docFlag interface {
	cli.DocGenerationFlag
	cli.CategorizableFlag
	cli.RequiredFlag
}

// EnvAfterArgs makes each of flags an EnvFlag: a flag of cli's own types
// (*cli.StringFlag, *cli.DurationFlag, ...), each with an EnvVars field.
func EnvAfterArgs(flags []cli.Flag) []cli.Flag {
	out := make([]cli.Flag, len(flags))
	for i, f := range flags {
		out[i] = EnvFlag{f.(docFlag)}
	}
	return out
}

// Unwrap returns the flag as declared (a *cli.DurationFlag, ...).
func (f EnvFlag) Unwrap() cli.Flag { return f.docFlag }

// Apply adds the flag to set without reading its variables.
func (f EnvFlag) Apply(set *flag.FlagSet) error {
	env := reflect.ValueOf(f.docFlag).Elem().FieldByName("EnvVars")
	vars := env.Interface().([]string)
	env.Set(reflect.Zero(env.Type()))
	defer env.Set(reflect.ValueOf(vars))
	return f.docFlag.Apply(set)
}

// ApplyEnv, the Before of the command whose flags are EnvFlags, sets
// each flag the command line left unset from its variable, where that is
// set: a string flag even to "", as cli did, any other flag only to a
// value (cli skipped an empty one). A value that does not parse is a
// usage error (exit 2) naming the variable and what the flag takes. The
// flags set from a variable are recorded for FromEnv.
func ApplyEnv(c *cli.Context) error {
	taken := map[string]string{}
	if c.App.Metadata == nil {
		c.App.Metadata = map[string]any{}
	}
	c.App.Metadata[fromEnvKey] = taken
	for _, f := range commandFlags(c) {
		ef, ok := f.(EnvFlag)
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
				return cli.Exit(fmt.Sprintf("%s=%q (--%s): %s; unset it, or give --%s", v, val, name, Want(ef.docFlag), name), 2)
			}
			taken[name] = v
			break
		}
	}
	return nil
}

// FromVariable returns the variable ApplyEnv set flag name from, "" when
// it did not (the command line gave the flag, or nothing did): c.IsSet
// is true of both.
func FromVariable(c *cli.Context, name string) string {
	taken, _ := c.App.Metadata[fromEnvKey].(map[string]string)
	return taken[name]
}

// commandFlags returns the flags of c's command (the app's, at the top).
func commandFlags(c *cli.Context) []cli.Flag {
	if c.Command != nil {
		return c.Command.Flags
	}
	return c.App.Flags
}

// fromEnvKey is where ApplyEnv leaves, in the app's Metadata, the flags
// it set from a variable (flag name to variable).
const fromEnvKey = "from-env"

// FromEnv returns err, a usage error (exit 2) of a command's checks,
// saying which of the flags it names came from a variable, not the
// command line ("--max-body-bytes 0: want > 0 (--max-body-bytes from
// KVROUTER_MAX_BODY_BYTES)"; FromEnvNote): the operator gave no such
// flag, and would look for it there. Any other error is returned as it
// is.
func FromEnv(c *cli.Context, err error) error {
	var ec cli.ExitCoder
	if err == nil || !errors.As(err, &ec) || ec.ExitCode() != 2 {
		return err
	}
	msg := err.Error()
	if noted := FromEnvNote(c.App, commandFlags(c), msg); noted != msg {
		return cli.Exit(noted, 2)
	}
	return err
}

// FromEnvNote returns msg, a usage error's message, followed by which of
// flags (of app: their variables read by ApplyEnv) it names came from a
// variable: "(--timeout from KVCTL_TIMEOUT)", for a binary whose usage
// errors are no cli.ExitCoder. The variable's value is not repeated (a
// URL can carry a password); the message shows what the check took of
// it. msg is returned as it is where it names none.
func FromEnvNote(app *cli.App, flags []cli.Flag, msg string) string {
	taken, _ := app.Metadata[fromEnvKey].(map[string]string)
	var from []string
	for _, f := range flags {
		name := f.Names()[0]
		if v, ok := taken[name]; ok && namesFlag(msg, name) {
			from = append(from, "--"+name+" from "+v)
		}
	}
	if len(from) == 0 {
		return msg
	}
	return msg + " (" + strings.Join(from, ", ") + ")"
}

// namesFlag reports whether msg names --name (not a longer flag that
// starts with it: --nats-url is not --nats-user).
func namesFlag(msg, name string) bool {
	for rest := msg; ; {
		i := strings.Index(rest, "--"+name)
		if i < 0 {
			return false
		}
		rest = rest[i+2+len(name):]
		if rest == "" || !isFlagChar(rest[0]) {
			return true
		}
	}
}

func isFlagChar(b byte) bool {
	return b == '-' || b >= 'a' && b <= 'z' || b >= '0' && b <= '9'
}

// OnCommandLine reports whether flag name was given on the command line,
// not set from its variable by ApplyEnv: c.IsSet is true of both.
func OnCommandLine(c *cli.Context, name string) bool {
	return c.IsSet(name) && FromVariable(c, name) == ""
}

// TokenArgs returns the token and the token file of the --token and
// --token-file flags as the command line gives them when it gives either,
// else as the variables tokenVar and fileVar hold them, and whether they
// came from the command line: either flag given outranks both variables
// (docs/operations.md, "Security"), so that a KVCTL_TOKEN in the
// environment does not stand against --token-file given ("a token and a
// token file"). Both flags given, or both variables set, are left for
// the caller's client.Token to refuse. The flags may read the variables
// (EnvFlags, set by ApplyEnv) or not: a flag set from its variable counts
// as not given.
func TokenArgs(c *cli.Context, tokenVar, fileVar string) (token, file string, onCommandLine bool) {
	return TokenFlagArgs(c, "token", "token-file", tokenVar, fileVar)
}

// TokenFlagArgs is TokenArgs for a token flag and a token file flag of
// other names (kvagent's --router-token and --router-token-file).
func TokenFlagArgs(c *cli.Context, tokenFlag, fileFlag, tokenVar, fileVar string) (token, file string, onCommandLine bool) {
	if OnCommandLine(c, tokenFlag) || OnCommandLine(c, fileFlag) {
		for _, f := range []struct {
			name string
			val  *string
		}{{tokenFlag, &token}, {fileFlag, &file}} {
			if OnCommandLine(c, f.name) {
				*f.val = c.String(f.name)
			}
		}
		return token, file, true
	}
	return os.Getenv(tokenVar), os.Getenv(fileVar), false
}
