package main

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"strings"
	"sync"
	"time"

	"github.com/kvrouter/kvrouter/api"
	"github.com/kvrouter/kvrouter/api/client"
	"github.com/kvrouter/kvrouter/internal/clihelp"
	"github.com/kvrouter/kvrouter/raftfsm"
	"github.com/urfave/cli/v2"
)

// env is everything kvctl touches outside its arguments, so that tests can
// run the whole command line in-process.
type env struct {
	stdout, stderr io.Writer
	stdin          io.Reader
	terminal       bool // stderr is a terminal: long operations show progress there
	inspect        func(r io.Reader) (raftfsm.SnapshotInfo, error)
	seed           func(ctx context.Context, snapshotPath, dataDir, nodeID string, peers []raftfsm.Member) error
}

// openLocal opens a local file for reading such that an interrupt (ctx's
// end) ends kvctl's wait on it, returning ctx's error, when the file is a
// FIFO (a named pipe, which a producer writes): open(2) waits there in
// the kernel for the producer to open it, out of reach of ctx and of any
// signal, and a read waits for a producer that stalled. So the open runs
// in a goroutine, abandoned at ctx's end (the file it opens later is
// closed), and the file is closed at ctx's end, which ends a read
// waiting on it: Go reads a FIFO through its poller, whose Close wakes
// the read. done closes the file and lets go of ctx; call it once the
// file is read.
func openLocal(ctx context.Context, path string) (f *os.File, done func(), err error) {
	type opened struct {
		f   *os.File
		err error
	}
	// Unbuffered: the open is handed over only to a caller still
	// waiting for it, else closed.
	ch := make(chan opened)
	go func() {
		f, err := os.Open(path)
		select {
		case ch <- opened{f, err}:
		case <-ctx.Done():
			if err == nil {
				f.Close()
			}
		}
	}()
	select {
	case o := <-ch:
		if o.err != nil {
			return nil, nil, o.err
		}
		stop := context.AfterFunc(ctx, func() { o.f.Close() })
		return o.f, func() {
			stop()
			o.f.Close()
		}, nil
	case <-ctx.Done():
		return nil, nil, ctx.Err()
	}
}

// readAll reads r to its end, or until ctx ends: a read that blocks
// (stdin from a terminal, a producer that stalled, a FIFO) does not hold
// kvctl past an interrupt. Such a read goes on, abandoned, until r gives
// something or ends; kvctl exits meanwhile.
func readAll(ctx context.Context, r io.Reader) ([]byte, error) {
	type read struct {
		data []byte
		err  error
	}
	done := make(chan read, 1)
	go func() {
		data, err := io.ReadAll(r)
		done <- read{data, err}
	}()
	select {
	case rd := <-done:
		return rd.data, rd.err
	case <-ctx.Done():
		return nil, ctx.Err()
	}
}

// Exit codes.
const (
	exitOK    = 0
	exitError = 1
	exitUsage = 2
)

// usageError is a command line that kvctl cannot run as written: exit 2.
type usageError struct{ msg string }

func (e *usageError) Error() string { return e.msg }

func usagef(format string, args ...any) error {
	return &usageError{msg: fmt.Sprintf(format, args...)}
}

// run runs kvctl with args (args[0] is the program name) and returns its
// exit code. Errors are reported on e.stderr, one line each.
func run(ctx context.Context, args []string, e *env) int {
	app := newApp(e)
	args, err := helpPath(app, args)
	if err == nil {
		args, err = hoistFlags(app, args)
	}
	if err == nil {
		err = app.RunContext(ctx, args)
	}
	if h := app.Metadata["help-not-found"].(*helpNotFound); err == nil && h.err != nil {
		err = h.err
	}
	if err == nil {
		return exitOK
	}
	// A value refused that came from a global flag's variable, the flag
	// left out, is named as the variable.
	var ue *usageError
	if errors.As(err, &ue) {
		ue.msg = clihelp.FromEnvNote(app, app.Flags, ue.msg)
	}
	fmt.Fprintln(e.stderr, "kvctl: "+oneLine(explain(err)))
	if errors.As(err, new(*usageError)) {
		return exitUsage
	}
	return exitError
}

// helpNotFound is where the help command's CommandNotFound leaves its
// usage error (app.Metadata's "help-not-found"): urfave/cli's help answers
// nil after calling it, and without it a bare "No help topic for 'WORD'".
type helpNotFound struct{ err error }

// unknownHelpTopic is the app's CommandNotFound, which urfave/cli calls
// only for `kvctl help WORD` and `kvctl GROUP help WORD` where WORD names
// no command: a usage error (exit 2) that names the word and says where
// the commands are listed, as helpPath's for a longer path.
func unknownHelpTopic(c *cli.Context, word string) {
	where := helpName(c)
	if h, ok := c.App.Metadata["help-not-found"].(*helpNotFound); ok {
		h.err = usagef("kvctl help: %s has no command %q; see %s --help", where, word, where)
	}
}

func newApp(e *env) *cli.App {
	app := &cli.App{
		Name:  "kvctl",
		Usage: "operate a kvrouter cluster",
		Description: "kvctl talks to the nodes' HTTP API. Reads are answered by the first endpoint that\n" +
			"answers; writes may go to any node, which forwards them to the leader.\n\n" +
			"Example:\n" +
			"   kvctl --endpoints 10.0.0.1:7080,10.0.0.2:7080,10.0.0.3:7080 status",
		Writer:      e.stdout,
		ErrWriter:   e.stderr,
		HideVersion: true,
		// The variables are read after the command line, for the flags
		// it left out (clihelp.ApplyEnv, in Before): a flag given
		// outranks its variable, even one that does not parse.
		Flags: clihelp.EnvAfterArgs([]cli.Flag{
			&cli.StringFlag{Name: "endpoints", Value: "127.0.0.1:7080", EnvVars: []string{"KVCTL_ENDPOINTS"},
				Usage: "the nodes' HTTP addresses, host:port,..."},
			&cli.DurationFlag{Name: "timeout", Value: 10 * time.Second, EnvVars: []string{"KVCTL_TIMEOUT"},
				Usage: "how long a command may take (snapshot save and restore: see their --max-time)"},
			&cli.StringFlag{Name: "output", Aliases: []string{"o"}, Value: "table", EnvVars: []string{"KVCTL_OUTPUT"},
				Usage: "output format: table or json"},
			// KVCTL_TOKEN and KVCTL_TOKEN_FILE are read by clihelp.TokenArgs, not
			// as EnvVars: the help names them as it names the others.
			&cli.StringFlag{Name: "token",
				Usage: "the cluster's bearer token, when its nodes ask for one (kvrouter --token) [$KVCTL_TOKEN]"},
			&cli.StringFlag{Name: "token-file",
				Usage: "read --token from this file [$KVCTL_TOKEN_FILE]"},
			&cli.StringFlag{Name: "tls-ca", EnvVars: []string{"KVCTL_TLS_CA"},
				Usage: "PEM CA of the nodes' certificates: reach host:port endpoints over TLS, trusting it (an https:// endpoint trusts the system's roots without it)"},
		}),
		Before: func(c *cli.Context) error {
			if err := clihelp.ApplyEnv(c); err != nil {
				return usagef("%s", err.Error())
			}
			switch c.String("output") {
			case "table", "json":
			default:
				// Named as the variable when it came from one: the
				// command line holds no -o (FromEnvNote looks for
				// --output, which the message does not say).
				msg := fmt.Sprintf("-o %q: want table or json", c.String("output"))
				if v := clihelp.FromVariable(c, "output"); v != "" {
					msg += " (-o from " + v + ")"
				}
				return usagef("%s", msg)
			}
			if c.Duration("timeout") <= 0 {
				return usagef("--timeout %v: want a positive duration such as 10s", c.Duration("timeout"))
			}
			return nil
		},
		Action: func(c *cli.Context) error {
			if c.Args().Present() {
				return usagef("unknown command %q; kvctl --help lists the commands", c.Args().First())
			}
			usageHelp(c, cli.ShowAppHelp)
			return usagef("a command is needed; kvctl --help lists them")
		},
		ExitErrHandler:  func(*cli.Context, error) {}, // run decides the exit code, never os.Exit
		Metadata:        map[string]any{"client-files": &clientFiles{}, "help-not-found": &helpNotFound{}},
		CommandNotFound: unknownHelpTopic,
		Commands: []*cli.Command{
			statusCommand(e),
			membersCommand(e),
			leaderCommand(e),
			workersCommand(e),
			routeCommand(e),
			indexCommand(e),
			settingsCommand(e),
			snapshotCommand(e),
		},
	}
	app.OnUsageError = onUsageError
	for _, c := range app.Commands {
		setUsageErrors(c)
	}
	return app
}

// onUsageError is the usage error of a command line that did not parse:
// the flag named as typed (--flag) and what it takes (clihelp.UsageError),
// then where the help is.
func onUsageError(c *cli.Context, err error, _ bool) error {
	flags := c.App.Flags
	if c.Command != nil {
		flags = c.Command.Flags
	}
	return usagef("%s", clihelp.UsageError(err, flags, helpName(c)+" --help"))
}

func helpName(c *cli.Context) string {
	if c.Command != nil && c.Command.HelpName != "" {
		return c.Command.HelpName
	}
	return "kvctl"
}

func setUsageErrors(c *cli.Command) {
	c.OnUsageError = onUsageError
	for _, s := range c.Subcommands {
		setUsageErrors(s)
	}
}

// group returns the action of a command that only holds subcommands.
func group(want string) cli.ActionFunc {
	return func(c *cli.Context) error {
		if c.Args().Present() {
			return usagef("unknown command %q (want %s); see %s --help", c.Args().First(), want, helpName(c))
		}
		usageHelp(c, cli.ShowSubcommandHelp)
		return usagef("%s needs a command: %s", helpName(c), want)
	}
}

// usageHelp shows help with a usage error: on stderr, with the error line,
// for stdout holds only what was asked for (-o json: only JSON). Help
// asked for with --help goes to stdout.
func usageHelp(c *cli.Context, show func(*cli.Context) error) {
	w := c.App.Writer
	c.App.Writer = c.App.ErrWriter
	defer func() { c.App.Writer = w }()
	_ = show(c)
}

// args checks the number of positional arguments, named by names (ID
// RAFTADDR HTTPADDR), and that none is empty or blank: an unset shell
// variable ("$NODE") is a mistake on the command line, not an ID or a path
// to send on.
func args(c *cli.Context, n int, names string) error {
	if c.NArg() != n {
		return usagef("%s takes %s (got %d argument(s)); see %s --help", helpName(c), names, c.NArg(), helpName(c))
	}
	name := strings.Fields(names)
	for i, a := range c.Args().Slice() {
		if strings.TrimSpace(a) == "" && i < len(name) {
			return usagef("%s: %s is empty; see %s --help", helpName(c), name[i], helpName(c))
		}
	}
	return nil
}

func jsonOut(c *cli.Context) bool { return c.String("output") == "json" }

// newClient returns a client of --endpoints for a command bounded by
// --timeout: each try of a node gives up on connecting, and on the answer's
// headers, after attemptTimeout, so that a node that accepts connections
// but never answers (stopped, wedged) leaves time to try the others.
func newClient(c *cli.Context) (*client.Client, error) {
	return newClientWith(c, endpointsArg(c), attemptTimeout(c), attemptTimeout(c))
}

// newClientWith returns a client of endpoints whose connections give up
// after dial and whose requests wait at most headers for an answer's
// headers once sent (0: no bound; the context's).
func newClientWith(c *cli.Context, endpoints []string, dial, headers time.Duration) (*client.Client, error) {
	token, tlsConfig, err := clientFilesOf(c)
	if err != nil {
		return nil, err
	}
	dialer := &net.Dialer{Timeout: dial, KeepAlive: 30 * time.Second}
	tr := http.DefaultTransport.(*http.Transport).Clone()
	tr.DialContext = dialer.DialContext
	tr.TLSHandshakeTimeout = dial // a node that accepts and never answers costs a try's share, TLS or not
	tr.ResponseHeaderTimeout = headers
	scheme := "http"
	if tlsConfig != nil {
		tr.TLSClientConfig = tlsConfig.Clone()
		scheme = "https"
	}
	cl, err := client.New(endpoints, client.Options{HTTPClient: &http.Client{Transport: tr}, UserAgent: "kvctl", Token: token, Scheme: scheme})
	if err != nil {
		return nil, usagef("--endpoints %q: %v", client.RedactEndpoints(c.String("endpoints")), err)
	}
	if token != "" && c.App.Metadata["warned-clear-token"] == nil {
		if clear := cl.ClearText(); len(clear) > 0 {
			c.App.Metadata["warned-clear-token"] = true
			fmt.Fprintf(c.App.ErrWriter, "kvctl: warning: the token goes to %s in clear text: give --tls-ca, or https:// endpoints\n", strings.Join(clear, ", "))
		}
	}
	return cl, nil
}

// clientFiles is what --token-file (or --token) and --tls-ca give, read
// once per command: a command may make several clients (a restore's
// probes, one per endpoint), and a FIFO or a process substitution
// (--token-file <(pass show kvrouter)) gives its content once.
type clientFiles struct {
	once  sync.Once
	token string
	tls   *tls.Config // nil without --tls-ca
	err   error
}

// clientFilesOf returns the command's token and TLS configuration (nil:
// plain HTTP), reading the files the first time. They are read through
// openLocal, so that an interrupt ends a wait on a FIFO's producer (exit
// 1, interrupted), and no more than client.MaxTokenFileBytes and
// client.MaxCAFileBytes of them: a file that cannot be read, is larger,
// or holds no token or no PEM certificate is a usage error naming its
// flag.
func clientFilesOf(c *cli.Context) (string, *tls.Config, error) {
	cf := c.App.Metadata["client-files"].(*clientFiles)
	cf.once.Do(func() {
		ctx := c.Context
		open := func(path string) (io.ReadCloser, error) {
			f, done, err := openLocal(ctx, path)
			if err != nil {
				return nil, err
			}
			return ctxReadCloser{raftfsm.ContextReader(ctx, f), done}, nil
		}
		// An interrupt is not the flag's fault: its error goes as it is.
		flagErr := func(names string, err error) error {
			if ctx.Err() != nil {
				return ctx.Err()
			}
			return usagef("%s: %v", names, err)
		}
		// Either token flag given outranks both variables, read by
		// clihelp.TokenArgs, not as EnvVars: urfave/cli could not tell a
		// variable from a flag, and KVCTL_TOKEN with --token-file given
		// was "a token and a token file".
		token, file, given := clihelp.TokenArgs(c, "KVCTL_TOKEN", "KVCTL_TOKEN_FILE")
		if cf.token, cf.err = client.TokenFrom(token, file, open); cf.err != nil {
			names := "--token, --token-file"
			if !given {
				names = "KVCTL_TOKEN, KVCTL_TOKEN_FILE"
			}
			cf.err = flagErr(names, cf.err)
			return
		}
		if ca := c.String("tls-ca"); ca != "" {
			if cf.tls, cf.err = client.TLSConfigFrom(ca, open); cf.err != nil {
				cf.err = flagErr("--tls-ca", cf.err)
			}
		}
	})
	return cf.token, cf.tls, cf.err
}

// ctxReadCloser is a file opened by openLocal, read through ctx: Close
// is openLocal's done.
type ctxReadCloser struct {
	io.Reader
	done func()
}

func (r ctxReadCloser) Close() error {
	r.done()
	return nil
}

func endpointsArg(c *cli.Context) []string { return strings.Split(c.String("endpoints"), ",") }

// attemptTimeout is how long one try of one node may wait: an equal share
// of --timeout per endpoint, but at least 2 s (or --timeout, if shorter),
// since a busy node can take a second or two.
func attemptTimeout(c *cli.Context) time.Duration {
	total := c.Duration("timeout")
	share := total / time.Duration(len(endpointsArg(c)))
	return max(share, min(total, 2*time.Second))
}

// withClient runs f with a client and a context bounded by --timeout.
func withClient(c *cli.Context, f func(ctx context.Context, cl *client.Client) error) error {
	cl, err := newClient(c)
	if err != nil {
		return err
	}
	defer cl.Close()
	ctx, cancel := context.WithTimeout(c.Context, c.Duration("timeout"))
	defer cancel()
	err = f(ctx, cl)
	if err != nil && errors.Is(err, context.DeadlineExceeded) && c.Context.Err() == nil {
		return fmt.Errorf("no answer within --timeout %v: %w", c.Duration("timeout"), err)
	}
	return err
}

// reasonHint is an error of a command with what to do when the node
// answered it with reason: what depends on the command, which explain does
// not know (413 too_large: which limit the body passed; shutting_down in a
// save's stream: the save is to be sent again).
type reasonHint struct {
	err    error
	reason string
	hint   string
}

func (h *reasonHint) Error() string { return h.err.Error() }
func (h *reasonHint) Unwrap() error { return h.err }

// withReasonHint wraps a non-nil err with hint, for explain to print
// after it when the node answered it with reason.
func withReasonHint(err error, reason, hint string) error {
	if err == nil {
		return nil
	}
	return &reasonHint{err: err, reason: reason, hint: hint}
}

// withTooLargeHint wraps a non-nil err with hint, for explain to print
// after it when the node answered 413 too_large.
func withTooLargeHint(err error, hint string) error {
	return withReasonHint(err, api.ReasonTooLarge, hint)
}

// explain turns an error into the line kvctl prints: what went wrong and
// what to do about it.
func explain(err error) string {
	var ue *usageError
	var ae *client.Error
	var mt *maxTimeError
	msg := err.Error()
	// An answer's text may be another node's (a follower's forward to its
	// leader): only kvctl's own transport errors say what its TLS settings
	// got wrong, and the plain 400 of a TLS node asked in plain HTTP.
	answer := errors.As(err, &ae)
	certHint := client.CertificateHint(err, "--tls-ca")
	switch {
	case errors.As(err, &ue):
		return ue.msg
	// A certificate kvctl's own handshake refused: its x509 error says why
	// (client.CertificateHint); the transport's words are read only for
	// errors that lost it.
	case !answer && certHint != "":
		return msg + "; " + certHint
	case !answer && strings.Contains(msg, "x509: certificate is valid for"):
		return msg + "; the node's certificate does not name the address in --endpoints: use the address it names"
	case !answer && strings.Contains(msg, "x509:"):
		return msg + "; the node's certificate is not trusted: give --tls-ca with the CA that signed it"
	case answer && ae.Reason == "" && strings.Contains(msg, "HTTP request to an HTTPS server"):
		return msg + "; the node serves TLS: give --tls-ca, or https:// endpoints"
	case !answer && strings.Contains(msg, "server gave HTTP response to HTTPS client"):
		return msg + "; the node serves plain HTTP: leave out --tls-ca and the https:// of --endpoints"
	case answer && ae.Reason == api.ReasonNoLeader && strings.Contains(msg, "forward to the leader") &&
		(strings.Contains(msg, "x509:") || strings.Contains(msg, "HTTPS")):
		return msg + "; the node's forward to its leader failed TLS: check that node's --tls-ca and the leader's certificate"
	// Before --max-time's advice: a restore cut off after it went out
	// whole may be installed, and sending it again would install it twice.
	case errors.Is(err, client.ErrOutcomeUnknown):
		return err.Error() + "; see kvctl status (and kvctl members list) before sending it again"
	case errors.As(err, &mt):
		return fmt.Sprintf("%v; the transfer took longer than --max-time %v: raise it, or leave it out (no limit)", err, mt.max)
	case errors.Is(err, client.ErrUnauthorized):
		return err.Error() + "; give the cluster's token with --token or --token-file (or KVCTL_TOKEN)"
	case errors.Is(err, client.ErrNotHTTP):
		return err.Error() + "; that address is not a node's HTTP port (another service's, such as a node's NATS port): check --endpoints (or KVCTL_ENDPOINTS)"
	case errors.Is(err, client.ErrNotAnAnswer):
		return err.Error() + "; that address is not a node's HTTP API: check --endpoints (or KVCTL_ENDPOINTS)"
	case errors.Is(err, client.ErrUnreachable):
		return err.Error() + "; check --endpoints (or KVCTL_ENDPOINTS) and that the nodes run"
	case errors.Is(err, context.Canceled):
		return "interrupted"
	case errors.Is(err, context.DeadlineExceeded):
		return err.Error() + "; raise --timeout, or see kvctl status"
	case errors.As(err, &ae):
		var h *reasonHint
		if errors.As(err, &h) && h.reason == ae.Reason {
			return err.Error() + "; " + h.hint
		}
		switch ae.Reason {
		case api.ReasonNoLeader:
			return err.Error() + "; the cluster has no leader right now: check kvctl status and retry (a cluster that lost a majority of its members for good elects none: see Majority lost in docs/operations.md)"
		case api.ReasonOverloaded:
			return err.Error() + "; every rank is busy: retry later, add workers or raise the busy thresholds"
		case api.ReasonNoWorkers:
			return err.Error() + "; no worker can take requests: register workers first (kvctl workers lists them)"
		case api.ReasonUnknownWorker:
			return err.Error() + "; kvctl workers lists the registered workers"
		case api.ReasonBadSnapshot:
			return err.Error() + "; the file is damaged or not a snapshot: take a new one with kvctl snapshot save"
		case api.ReasonInsufficientStorage:
			return err.Error() + "; nothing was installed: free space on the leader's data directory (kvctl status names the leader) and restore again"
		case api.ReasonTimeout:
			return err.Error() + "; the write may still apply: check with kvctl status (and kvctl members list) before retrying it"
		case api.ReasonShuttingDown:
			return err.Error() + "; the node is stopping: use another endpoint"
		case api.ReasonStateReplaced:
			return err.Error() + "; retry the save: it reads the restored state"
		case api.ReasonUnreachable:
			return err.Error() + "; nothing changed: kvctl status on that member shows whether it is up"
		case api.ReasonNotReady:
			return err.Error() + "; the node is starting or catching up: retry, or use another endpoint"
		case api.ReasonInternal:
			return err.Error() + "; see the node's log"
		case api.ReasonTooLarge:
			return err.Error() + "; the request is larger than the node takes"
		// kvctl builds its requests itself: a node that cannot read one,
		// or serves no such path or method, is most likely of another
		// release than kvctl.
		case api.ReasonBadJSON, api.ReasonNotFound, api.ReasonMethodNotAllowed:
			return err.Error() + "; the node does not take this request: use a kvctl of the nodes' release"
		case api.ReasonInvalid:
			return err.Error() + "; nothing changed: correct the value the message names (kvctl help shows the command's arguments)"
		case api.ReasonUnknownRank, api.ReasonUnregisteredRank:
			return err.Error() + "; kvctl workers lists the registered workers and their ranks"
		case api.ReasonStaleDump:
			return err.Error() + "; nothing applied: the rank's events are newer than the dump, take a new one"
		case api.ReasonConflict:
			return err.Error() + "; nothing changed: kvctl workers lists the registered workers"
		case api.ReasonRequestTimeout:
			return err.Error() + "; nothing applied: the request's body reached the node too slowly, send it again"
		case api.ReasonCanceled:
			return err.Error() + "; the node's work was cut off: retry"
		}
	}
	return err.Error()
}

func oneLine(s string) string {
	s = strings.ReplaceAll(s, "\r\n", " ")
	return strings.Join(strings.Fields(strings.ReplaceAll(s, "\n", " ")), " ")
}
