package natswatch

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"

	"github.com/kvrouter/kvrouter/eventplane"
	"github.com/kvrouter/kvrouter/internal/testlog"
)

// watched is a Watch of "the node" logging to logs, its handlers as
// nats.Connect would take them, and the context its lost ends.
type watched struct {
	w    *Watch
	logs *testlog.Buffer
	ctx  context.Context
	h    nats.Options
}

func watch(t *testing.T) *watched {
	t.Helper()
	logs := &testlog.Buffer{}
	ctx, lost := context.WithCancelCause(context.Background())
	t.Cleanup(func() { lost(nil) })
	w := New(slog.New(slog.NewTextHandler(logs, nil)), lost, Texts{Who: "the node", Unreachable: "check --nats-url", Lost: "nothing is heard"})
	v := &watched{w: w, logs: logs, ctx: ctx}
	for _, o := range w.Options() {
		if err := o(&v.h); err != nil {
			t.Fatal(err)
		}
	}
	return v
}

// conn is a connection as the handlers are handed one: not connected, no
// last error.
var conn = &nats.Conn{}

// TestTheOwnersCloseIsNoLoss: a connection the owner closes (Closing,
// then nats.Conn.Close, which reports a disconnect and the close) ends
// nothing and logs nothing: the daemon is stopping.
func TestTheOwnersCloseIsNoLoss(t *testing.T) {
	v := watch(t)
	v.w.Closing()
	v.h.DisconnectedErrCB(conn, nil)
	v.h.ClosedCB(conn)
	if v.ctx.Err() != nil || Ended(v.ctx) != nil {
		t.Errorf("the owner's close ended the daemon: %v", context.Cause(v.ctx))
	}
	if s := v.logs.String(); s != "" {
		t.Errorf("the owner's close is logged:\n%s", s)
	}
}

// TestAConnectionClosedForGoodEndsTheDaemon: a close the owner did not
// ask for (nats.go gave up after the credentials were refused twice) ends
// the daemon with ErrClosed, which Ended reports, and is logged as an
// error naming who stops.
func TestAConnectionClosedForGoodEndsTheDaemon(t *testing.T) {
	v := watch(t)
	v.h.ClosedCB(conn)
	if err := Ended(v.ctx); !errors.Is(err, ErrClosed) {
		t.Errorf("Ended after a close for good: %v, want %v", err, ErrClosed)
	}
	if got := v.logs.Lines("level=ERROR", "closed for good: the node stops"); len(got) != 1 {
		t.Errorf("a close for good logged %d errors saying the node stops, want 1:\n%s", len(got), v.logs)
	}
}

// TestACredsFileGoneBadEndsTheDaemon: CredsError (the connection's
// OnCredsError, called at each try) ends the daemon with ErrCreds,
// wrapping the file's error (which names --nats-creds), once the file
// has failed credsTries tries over credsGrace, and logs the stop once.
func TestACredsFileGoneBadEndsTheDaemon(t *testing.T) {
	v := watch(t)
	start := time.Now()
	at := start
	v.w.now = func() time.Time { return at }
	bad := errors.New(`--nats-creds "u.creds": no user JWT`)
	for range credsTries {
		v.w.CredsError(bad)
	}
	if v.ctx.Err() != nil {
		t.Fatalf("%d tries of a creds file bad for less than %v ended the daemon: %v", credsTries, credsGrace, context.Cause(v.ctx))
	}
	at = start.Add(credsGrace)
	v.w.CredsError(bad)
	v.w.CredsError(bad)
	err := Ended(v.ctx)
	if !errors.Is(err, ErrCreds) || !strings.Contains(err.Error(), "--nats-creds") {
		t.Errorf("Ended after a creds file gone bad: %v, want %v naming --nats-creds", err, ErrCreds)
	}
	if got := v.logs.Lines("level=ERROR", "the node stops"); len(got) != 1 {
		t.Errorf("two tries of a creds file gone bad logged %d errors, want 1:\n%s", len(got), v.logs)
	}
}

// TestACredsFileBadForOneTryEndsNothing: a try that found the file bad
// (a rewrite that is not atomic racing it), then a connection made, ends
// the run of failures: failures long after it do not add up with it.
func TestACredsFileBadForOneTryEndsNothing(t *testing.T) {
	v := watch(t)
	start := time.Now()
	at := start
	v.w.now = func() time.Time { return at }
	bad := errors.New(`--nats-creds "u.creds": open u.creds: no such file or directory`)
	v.w.CredsError(bad)
	v.h.ReconnectedCB(conn)
	// credsTries tries over a minute with the first: a run of them
	// without the connection made between.
	at = start.Add(time.Minute)
	for range credsTries - 1 {
		v.w.CredsError(bad)
		at = at.Add(credsGrace)
	}
	if v.ctx.Err() != nil {
		t.Errorf("a creds file bad for one try, then a connection, then %d tries, ended the daemon: %v", credsTries-1, context.Cause(v.ctx))
	}
	if got := v.logs.Lines("level=WARN", "--nats-creds file holds no credentials; retrying"); len(got) != 2 {
		t.Errorf("two runs of failures logged %d warnings, want 2:\n%s", len(got), v.logs)
	}
}

// TestACredsRunEndsWithATryThatReadTheFileWhole: a try that read the
// creds file whole, which the server then refused (it can only once the
// credentials were read and sent), ends CredsError's run as a connection
// made does: a bad read, that refusal, and two bad reads a minute later
// (a second rewrite that is not atomic, racing two tries) are not
// credsTries tries in a row, and stop nothing.
func TestACredsRunEndsWithATryThatReadTheFileWhole(t *testing.T) {
	for _, c := range []struct {
		name    string
		refused func(v *watched)
	}{
		{"the try's own error", func(v *watched) { v.h.ReconnectErrCB(conn, nats.ErrAuthorization) }},
		{"the asynchronous error", func(v *watched) {
			if err := v.w.ErrorHandler(prometheus.NewCounter(prometheus.CounterOpts{Name: "slow_total"}))(&v.h); err != nil {
				t.Fatal(err)
			}
			v.h.AsyncErrorCB(conn, nil, nats.ErrAuthExpired)
		}},
	} {
		t.Run(c.name, func(t *testing.T) {
			v := watch(t)
			start := time.Now()
			at := start
			v.w.now = func() time.Time { return at }
			bad := errors.New(`--nats-creds "u.creds": open u.creds: no such file or directory`)
			v.w.CredsError(bad)
			at = at.Add(250 * time.Millisecond)
			c.refused(v)
			at = start.Add(time.Minute)
			v.w.CredsError(bad)
			at = at.Add(250 * time.Millisecond)
			v.w.CredsError(bad)
			if v.ctx.Err() != nil {
				t.Errorf("two bad reads in a row, after a try the server refused, ended the daemon: %v", context.Cause(v.ctx))
			}
		})
	}
}

// TestACredsRunGoesOnThroughTriesThatReadTheFileBad: a try that failed on
// the file itself is reported to ReconnectErrHandler too (an error Refused
// takes, naming --nats-creds), and ends no run: the file still stops the
// daemon once it has failed credsTries tries over credsGrace.
func TestACredsRunGoesOnThroughTriesThatReadTheFileBad(t *testing.T) {
	v := watch(t)
	start := time.Now()
	at := start
	v.w.now = func() time.Time { return at }
	bad := errors.New(`--nats-creds "u.creds": nkeys: no nkey seed found`)
	for i := range credsTries {
		at = start.Add(time.Duration(i) * credsGrace)
		v.w.CredsError(bad)
		v.h.ReconnectErrCB(conn, bad)
	}
	if err := Ended(v.ctx); !errors.Is(err, ErrCreds) {
		t.Errorf("Ended after %d tries that read the file bad over %v: %v, want %v", credsTries, 2*credsGrace, err, ErrCreds)
	}
}

// TestEndedIsOnlyTheWatchs: a context ended otherwise (a signal, the
// owner's own end) is not the Watch's: Ended is nil.
func TestEndedIsOnlyTheWatchs(t *testing.T) {
	ctx, cancel := context.WithCancelCause(context.Background())
	if Ended(ctx) != nil {
		t.Errorf("Ended of a running context: %v", Ended(ctx))
	}
	cancel(errors.New("a signal"))
	if Ended(ctx) != nil {
		t.Errorf("Ended of a context cancelled otherwise: %v, want nil", Ended(ctx))
	}
}

// TestARunOfFailuresIsLoggedOnce: the tries that fail are logged once
// per run of them, a refusal of the credentials as such; a lost
// connection is a warning and starts a run (its reconnect tries are not
// logged again); a connection made, or made again, ends the run (Info),
// and the next failure is logged anew.
func TestARunOfFailuresIsLoggedOnce(t *testing.T) {
	v := watch(t)
	unreachable := errors.New("dial tcp 127.0.0.1:4222: connect: connection refused")
	v.h.ReconnectErrCB(conn, unreachable)
	v.h.ReconnectErrCB(conn, unreachable)
	if got := v.logs.Lines("level=WARN", "cannot reach NATS", "check --nats-url"); len(got) != 1 {
		t.Errorf("two tries that could not reach NATS logged %d warnings, want 1:\n%s", len(got), v.logs)
	}
	v.h.ConnectedCB(conn)
	if got := v.logs.Lines("level=INFO", "connected to NATS"); len(got) != 1 {
		t.Errorf("the connection made logged %d lines, want 1:\n%s", len(got), v.logs)
	}
	v.h.DisconnectedErrCB(conn, errors.New("EOF"))
	v.h.ReconnectErrCB(conn, unreachable)
	if got := v.logs.Lines("level=WARN", "lost the NATS connection", "nothing is heard"); len(got) != 1 {
		t.Errorf("a lost connection logged %d warnings, want 1:\n%s", len(got), v.logs)
	}
	if got := v.logs.Lines("cannot reach NATS"); len(got) != 1 {
		t.Errorf("the reconnect tries after a lost connection logged again (%d lines), want them quiet:\n%s", len(got), v.logs)
	}
	v.h.ReconnectedCB(conn)
	if got := v.logs.Lines("level=INFO", "reconnected to NATS"); len(got) != 1 {
		t.Errorf("the connection made again logged %d lines, want 1:\n%s", len(got), v.logs)
	}
	v.h.ReconnectErrCB(conn, errors.New("nats: authorization violation"))
	if got := v.logs.Lines("level=WARN", "refused the node's credentials", "--nats-creds"); len(got) != 1 {
		t.Errorf("a refusal after the connection was made again logged %d warnings, want 1:\n%s", len(got), v.logs)
	}
	if v.ctx.Err() != nil {
		t.Errorf("failures nats.go retries ended the daemon: %v", context.Cause(v.ctx))
	}
}

// TestAReconnectRefusedIsLoggedAsARefusal: docs/operations.md says a run
// of failed tries is logged at Warn by its first, "NATS refused the
// node's credentials" when the server refuses them (check --nats-user,
// --nats-password, --nats-creds). A connection lost and then refused as
// it reconnects (the server restarted with other credentials) is the
// common case of a refusal, which nats.go reports to the error handler
// alone (Watch.ErrorHandler); the daemon then stops (ErrClosed).
func TestAReconnectRefusedIsLoggedAsARefusal(t *testing.T) {
	quiet := slog.New(slog.DiscardHandler)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close()
	s, err := eventplane.StartServer(eventplane.ServerConfig{Name: "a", Addr: addr, User: "u", Password: "old", Logger: quiet})
	if err != nil {
		t.Fatal(err)
	}
	logs := &testlog.Buffer{}
	log := slog.New(slog.NewTextHandler(logs, nil))
	ctx, lost := context.WithCancelCause(context.Background())
	defer lost(nil)
	w := New(log, lost, Texts{Who: "the node", Unreachable: "check --nats-url", Lost: "nothing is heard"})
	o := eventplane.ClientOptions{User: "u", Password: "old"}
	opts := append(o.NATSOptions(), nats.RetryOnFailedConnect(true),
		w.ErrorHandler(prometheus.NewCounter(prometheus.CounterOpts{Name: "slow_total"})))
	nc, err := nats.Connect("nats://"+addr, append(opts, w.Options()...)...)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { w.Closing(); nc.Close() }()
	deadline := time.Now().Add(10 * time.Second)
	for !nc.IsConnected() {
		if time.Now().After(deadline) {
			t.Fatal("not connected in 10 s")
		}
		time.Sleep(10 * time.Millisecond)
	}
	s.Shutdown()
	s.WaitForShutdown()
	s, err = eventplane.StartServer(eventplane.ServerConfig{Name: "a", Addr: addr, User: "u", Password: "new", Logger: quiet})
	if err != nil {
		t.Fatal(err)
	}
	defer func() { s.Shutdown(); s.WaitForShutdown() }()
	select {
	case <-ctx.Done():
	case <-time.After(15 * time.Second):
		t.Fatalf("the refused connection did not end the daemon in 15 s:\n%s", logs)
	}
	if !errors.Is(Ended(ctx), ErrClosed) {
		t.Fatalf("Ended: %v, want ErrClosed", Ended(ctx))
	}
	// The refusal's callback may come after the close's.
	deadline = time.Now().Add(10 * time.Second)
	for len(logs.Lines("refused the node's credentials")) == 0 && time.Now().Before(deadline) {
		time.Sleep(5 * time.Millisecond)
	}
	if got := logs.Lines("level=WARN", "refused the node's credentials"); len(got) != 1 {
		t.Errorf("a reconnect the server refused logged %d lines saying the credentials were refused, want 1:\n%s", len(got), logs)
	}
}

// TestAConnectionDownIsRemindedAtError: while the connection has never
// been made, or is lost, each of Remind's ticks logs at Error for how
// long, saying what to check; while it is up, or the owner closes it,
// nothing.
func TestAConnectionDownIsRemindedAtError(t *testing.T) {
	v := watch(t)
	start := time.Unix(0, v.w.downSince.Load())
	v.w.now = func() time.Time { return start.Add(time.Minute) }
	v.w.remind()
	if got := v.logs.Lines("level=ERROR", "no NATS connection", "check --nats-url", "for=1m0s"); len(got) != 1 {
		t.Errorf("a connection never made logged %d reminders naming --nats-url and how long, want 1:\n%s", len(got), v.logs)
	}
	if v.w.Connected() {
		t.Error("Connected before the connection was made")
	}
	v.h.ConnectedCB(conn)
	v.w.remind()
	if !v.w.Connected() {
		t.Error("not Connected once made")
	}
	v.h.DisconnectedErrCB(conn, errors.New("EOF"))
	v.w.remind()
	if got := v.logs.Lines("level=ERROR", "no NATS connection"); len(got) != 2 {
		t.Errorf("a connection made, then lost, logged %d reminders in all, want 2:\n%s", len(got), v.logs)
	}
	v.w.Closing()
	v.w.remind()
	if got := v.logs.Lines("level=ERROR", "no NATS connection"); len(got) != 2 {
		t.Errorf("the owner's close was reminded:\n%s", v.logs)
	}
}

// TestRemindLogsAtEachTickUntilItsContextEnds: Remind logs the
// connection down at each tick of its interval, and returns once its
// context ends.
func TestRemindLogsAtEachTickUntilItsContextEnds(t *testing.T) {
	v := watch(t)
	v.w.every = time.Millisecond
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan struct{})
	go func() {
		defer close(done)
		v.w.Remind(ctx)
	}()
	deadline := time.Now().Add(10 * time.Second)
	for len(v.logs.Lines("level=ERROR", "no NATS connection")) < 3 {
		if time.Now().After(deadline) {
			t.Fatalf("Remind logged %d reminders in 10 s at an interval of %v, want 3 at least:\n%s",
				len(v.logs.Lines("level=ERROR", "no NATS connection")), v.w.every, v.logs)
		}
		select {
		case <-done:
			t.Fatalf("Remind returned before its context ended, having logged:\n%s", v.logs)
		case <-time.After(5 * time.Millisecond):
		}
	}
	cancel()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Fatal("Remind still running 10 s after its context ended")
	}
}

// TestRefused: the errors of credentials (refused by the server, or a
// creds file nats.go cannot use) are told from a server out of reach.
func TestRefused(t *testing.T) {
	for _, c := range []struct {
		err  string
		want bool
	}{
		{"nats: authorization violation", true},
		{"nats: Authentication Expired", true},
		{"nkeys: no nkey seed found", true},
		{"dial tcp 127.0.0.1:4222: connect: connection refused", false},
		{"nats: no servers available for connection", false},
		{"EOF", false},
	} {
		if got := Refused(errors.New(c.err)); got != c.want {
			t.Errorf("Refused(%q) = %v, want %v", c.err, got, c.want)
		}
	}
}

// TestASlowConsumerIsCountedAndLoggedOncePerEpisode: a subscription that
// falls behind (its pending limit reached: the client drops what comes
// next) is counted and logged once for its episode, with its subject, not
// once per message dropped, and not to stderr outside the log as nats.go's
// default handler did.
func TestASlowConsumerIsCountedAndLoggedOncePerEpisode(t *testing.T) {
	s, err := eventplane.StartServer(eventplane.ServerConfig{Name: "t", Addr: "127.0.0.1:0", Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	defer func() { s.Shutdown(); s.WaitForShutdown() }()
	logs := &testlog.Buffer{}
	slow := prometheus.NewCounter(prometheus.CounterOpts{Name: "slow_total"})
	nc, err := nats.Connect(s.ClientURL(), ErrorHandler(slog.New(slog.NewTextHandler(logs, nil)), slow))
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	release, took := make(chan struct{}), make(chan struct{}, 16)
	sub, err := nc.Subscribe("kv.events", func(*nats.Msg) {
		took <- struct{}{}
		<-release
	})
	if err != nil {
		t.Fatal(err)
	}
	if err := sub.SetPendingLimits(1, -1); err != nil {
		t.Fatal(err)
	}
	// One message held by the handler, one pending, the rest dropped.
	for range 6 {
		if err := nc.Publish("kv.events", []byte("x")); err != nil {
			t.Fatal(err)
		}
	}
	if err := nc.Flush(); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(10 * time.Second)
	for count(t, slow) == 0 || len(logs.Lines("fell behind")) == 0 {
		if time.Now().After(deadline) {
			t.Fatalf("no slow consumer counted (%v) and logged in 10 s:\n%s", count(t, slow), logs)
		}
		time.Sleep(5 * time.Millisecond)
	}
	close(release)
	if n := count(t, slow); n != 1 {
		t.Errorf("one episode of a slow consumer (4 messages dropped) counted %v times, want 1", n)
	}
	if got := logs.Lines("level=WARN", "fell behind", "subject=kv.events"); len(got) != 1 {
		t.Errorf("one episode of a slow consumer logged %d lines naming its subject, want 1:\n%s", len(got), logs)
	}
}

// TestASlowConsumerThatStaysBehindIsLoggedAtMostOncePerInterval: nats.go
// reports a subscription that stays behind again each time it has taken
// a message since (a new "episode" per message handled): each report is
// counted, but the log has one line per slowLogEvery, the next saying
// what was dropped since the last.
func TestASlowConsumerThatStaysBehindIsLoggedAtMostOncePerInterval(t *testing.T) {
	s, err := eventplane.StartServer(eventplane.ServerConfig{Name: "t", Addr: "127.0.0.1:0", Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	defer func() { s.Shutdown(); s.WaitForShutdown() }()
	logs := &testlog.Buffer{}
	slow := prometheus.NewCounter(prometheus.CounterOpts{Name: "slow_total"})
	var clock atomic.Int64 // seconds since the first report
	start := time.Now()
	h := newErrorHandler(slog.New(slog.NewTextHandler(logs, nil)), slow, func() time.Time {
		return start.Add(time.Duration(clock.Load()) * time.Second)
	})
	nc, err := nats.Connect(s.ClientURL(), nats.ErrorHandler(h.handle))
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	release, took := make(chan struct{}), make(chan struct{}, 1)
	defer close(release)
	sub, err := nc.Subscribe("kv.events", func(*nats.Msg) {
		took <- struct{}{}
		<-release
	})
	if err != nil {
		t.Fatal(err)
	}
	if err := sub.SetPendingLimits(2, -1); err != nil {
		t.Fatal(err)
	}
	// The handler holds a message (pending until it returns, for
	// nats.go); each round one is queued and 2 are dropped (a report), then the handler takes the queued one, and the
	// queue is empty again.
	if err := nc.Publish("kv.events", []byte("x")); err != nil {
		t.Fatal(err)
	}
	<-took
	const rounds = 5
	for round := 1; round <= rounds; round++ {
		if round == rounds {
			clock.Store(int64(slowLogEvery / time.Second)) // the last round's report comes an interval later
		}
		for range 3 {
			if err := nc.Publish("kv.events", []byte("x")); err != nil {
				t.Fatal(err)
			}
		}
		if err := nc.Flush(); err != nil {
			t.Fatal(err)
		}
		deadline := time.Now().Add(10 * time.Second)
		for count(t, slow) < float64(round) {
			if time.Now().After(deadline) {
				t.Fatalf("round %d: %v reports counted in 10 s:\n%s", round, count(t, slow), logs)
			}
			time.Sleep(5 * time.Millisecond)
		}
		release <- struct{}{}
		<-took
	}
	if n := count(t, slow); n != rounds {
		t.Errorf("%d reports of a slow consumer counted %v times, want %d", rounds, n, rounds)
	}
	// The report is counted before its line is written: wait for it.
	deadline := time.Now().Add(10 * time.Second)
	for len(logs.Lines("fell behind")) < 2 && time.Now().Before(deadline) {
		time.Sleep(5 * time.Millisecond)
	}
	got := logs.Lines("level=WARN", "fell behind", "subject=kv.events")
	if len(got) != 2 {
		t.Fatalf("a subscription that stayed behind for one interval logged %d lines, want 2 (the first report, and the first an interval later):\n%s", len(got), logs)
	}
	// Each round drops 2, the report read as the first is dropped (the
	// second may be yet to come): the second line counts those since the
	// first's, rounds 2 to 4 at least, not all so far.
	var first, since, total int
	if _, err := fmt.Sscanf(got[0][strings.Index(got[0], "dropped_total="):], "dropped_total=%d", &first); err != nil {
		t.Fatalf("%v: %s", err, got[0])
	}
	if _, err := fmt.Sscanf(got[1][strings.Index(got[1], "dropped="):], "dropped=%d dropped_total=%d", &since, &total); err != nil {
		t.Fatalf("%v: %s", err, got[1])
	}
	if since < 6 || since != total-first {
		t.Errorf("the second line counts %d dropped of %d, want those since the first line's %d (6 at least):\n%s", since, total, first, logs)
	}
}

// TestTheSlowConsumerLinesForgetSubscriptionsGone: the handler keeps the
// last line of a subscription that fell behind only while it is valid: a
// daemon that subscribes anew, each subscription falling behind once,
// keeps no line of each of those gone.
func TestTheSlowConsumerLinesForgetSubscriptionsGone(t *testing.T) {
	s, err := eventplane.StartServer(eventplane.ServerConfig{Name: "t", Addr: "127.0.0.1:0", Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	defer func() { s.Shutdown(); s.WaitForShutdown() }()
	nc, err := nats.Connect(s.ClientURL())
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	logs := &testlog.Buffer{}
	slow := prometheus.NewCounter(prometheus.CounterOpts{Name: "slow_total"})
	h := newErrorHandler(slog.New(slog.NewTextHandler(logs, nil)), slow, time.Now)
	const subs = 5
	for range subs {
		sub, err := nc.SubscribeSync("kv.events")
		if err != nil {
			t.Fatal(err)
		}
		h.handle(nc, sub, nats.ErrSlowConsumer)
		if err := sub.Unsubscribe(); err != nil {
			t.Fatal(err)
		}
	}
	if got := logs.Lines("level=WARN", "fell behind", "subject=kv.events"); len(got) != subs {
		t.Errorf("%d subscriptions that fell behind once logged %d lines, want %d:\n%s", subs, len(got), subs, logs)
	}
	h.mu.Lock()
	kept := len(h.logged)
	h.mu.Unlock()
	// The last one's line goes at the next report of any subscription.
	if kept > 1 {
		t.Errorf("the handler keeps the lines of %d subscriptions, %d of them gone before the last report, want 1 at most", kept, kept-1)
	}
}

// count is c's value.
func count(t *testing.T, c prometheus.Counter) float64 {
	t.Helper()
	var m dto.Metric
	if err := c.Write(&m); err != nil {
		t.Fatal(err)
	}
	return m.GetCounter().GetValue()
}
