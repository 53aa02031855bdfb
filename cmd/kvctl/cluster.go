package main

import (
	"context"
	"crypto/tls"
	"encoding/json"
	"errors"
	"fmt"
	"net/url"
	"slices"
	"strings"
	"time"

	"github.com/kvrouter/kvrouter/api"
	"github.com/kvrouter/kvrouter/api/client"
	"github.com/kvrouter/kvrouter/raftfsm"
	"github.com/urfave/cli/v2"
)

func statusCommand(e *env) *cli.Command {
	return &cli.Command{
		Name:  "status",
		Usage: "show every node's Raft and state status, one row per endpoint",
		Description: "Asks every endpoint for its own status: id, address, Raft state and term, last log\n" +
			"index, commit index, FSM applied index, leader, last contact with the leader, last\n" +
			"snapshot index, state digest and NATS connection. Replicas at the same applied index\n" +
			"must show the same digest; a node not connected to NATS is warned of (a leader without\n" +
			"it ingests no agent's events until it reconnects or, after its --nats-handover-after, hands\n" +
			"the leadership to a node connected to NATS). An endpoint that does not answer reads UNREACHABLE, and one that answers\n" +
			"with an error (401 without the token) or whose TLS does not match kvctl's reads ERROR,\n" +
			"with why in the row; either makes the exit code 1.\n\n" +
			"Example:\n" +
			"   kvctl --endpoints n1:7080,n2:7080,n3:7080 status\n" +
			"   kvctl status -o json",
		Action: func(c *cli.Context) error {
			if err := args(c, 0, "no arguments"); err != nil {
				return err
			}
			return withClient(c, func(ctx context.Context, cl *client.Client) error {
				res := cl.StatusAll(ctx)
				leader := leaderMembers(ctx, c, res)
				// An interrupt ends status as it ends every command (exit 1,
				// interrupted), during the statuses or the leader's members:
				// the requests it cut off are no node's failure, and their
				// rows would send the operator after nodes that run.
				if err := c.Context.Err(); err != nil {
					return err
				}
				return printStatus(c, e, res, leader)
			})
		},
	}
}

// statusRow is one endpoint's line of kvctl status -o json.
type statusRow struct {
	Endpoint string              `json:"endpoint"`
	Status   *raftfsm.NodeStatus `json:"status,omitempty"`
	// Failure is the table's STATE of an endpoint that gave no status:
	// failUnreachable or failError (answered is true); empty otherwise.
	Failure string `json:"failure,omitempty"`
	Error   string `json:"error,omitempty"`
	// Removed: the node was removed from the cluster, by its own word
	// (Status.Removed) or by the leader's (leftOut): a removed follower
	// that never got the entry removing it does not know.
	Removed bool `json:"removed,omitempty"`

	answered bool // Error is an answer or a TLS mismatch (failedNotUnreachable), not no answer
}

// The STATE of a row without a status, in the table and in the JSON's
// failure.
const (
	failUnreachable = "UNREACHABLE" // no answer
	failError       = "ERROR"       // an error answer, or TLS that does not match kvctl's
)

func printStatus(c *cli.Context, e *env, res []client.EndpointStatus, leader *leaderConfig) error {
	failed := 0
	var answered error // the first failure that is no endpoint unreachable: explain says what to do
	rows := make([]statusRow, len(res))
	for i, r := range res {
		rows[i] = statusRow{Endpoint: hostOf(r.Endpoint), Status: r.Status}
		if r.Status != nil {
			rows[i].Removed = r.Status.Removed || leader.leftOut(r.Status)
		}
		if r.Err != nil {
			failed++
			switch {
			case errors.Is(r.Err, client.ErrNotHTTP):
				// Not the try's text, which names the request and the
				// endpoint the row names already.
				r.Err = fmt.Errorf("not a kvrouter status: %w", client.ErrNotHTTP)
			case errors.Is(r.Err, client.ErrNotAnAnswer):
				// JSON of another shape ({"foo":1}): the client's text
				// says what a node's status has.
				r.Err = fmt.Errorf("not a kvrouter status: %w", errors.Unwrap(r.Err))
			case notAStatus(r.Err):
				r.Err = fmt.Errorf("not a kvrouter status (another service at that address?): %w", r.Err)
			}
			rows[i].Error = shortError(r.Err)
			rows[i].answered = failedNotUnreachable(r.Err)
			rows[i].Failure = failUnreachable
			if rows[i].answered {
				rows[i].Failure = failError
				if answered == nil {
					answered = r.Err
					if notAStatus(r.Err) {
						// Which endpoint, as a node's error answer names it.
						answered = fmt.Errorf("%s: %w", rows[i].Endpoint, r.Err)
					}
				}
			}
		}
	}
	if jsonOut(c) {
		if err := writeJSON(e.stdout, rows); err != nil {
			return err
		}
	} else {
		header := []string{"ENDPOINT", "ID", "STATE", "TERM", "LAST_INDEX", "COMMIT", "APPLIED", "LEADER",
			"LAST_CONTACT", "SNAPSHOT", "DIGEST", "READY"}
		// NATS only when a node reports it (every kvrouter does; a node of
		// a build before the field does not).
		nats := slices.ContainsFunc(rows, func(r statusRow) bool { return r.Status != nil && r.Status.NATS != "" })
		if nats {
			header = append(header, "NATS")
		}
		if failed > 0 {
			header = append(header, "ERROR")
		}
		t := newTable(e.stdout, header...)
		for _, r := range rows {
			if r.Status == nil {
				cells := []string{r.Endpoint, "-", r.Failure, "-", "-", "-", "-", "-", "-", "-", "-", "-"}
				if nats {
					cells = append(cells, "-")
				}
				t.row(append(cells, r.Error)...)
				continue
			}
			s := r.Status
			contact := ago(s.LastContactMs)
			if s.State == "Leader" {
				contact = "-"
			}
			ready := yesNo(s.Ready)
			switch {
			case r.Removed:
				ready = "removed"
			case s.ApplyHalted != "":
				ready = "halted"
			}
			cells := []string{r.Endpoint, orDash(s.ID), orDash(s.State), u64(s.Term), u64(s.LastIndex),
				u64(s.CommitIndex), u64(s.AppliedIndex), orDash(s.LeaderID), contact, u64(s.SnapshotIndex),
				orDash(s.Digest), ready}
			if nats {
				cells = append(cells, orDash(s.NATS))
			}
			if failed > 0 {
				cells = append(cells, "")
			}
			t.row(cells...)
		}
		if err := t.flush(); err != nil {
			return err
		}
	}
	for _, w := range divergence(rows) {
		fmt.Fprintln(e.stderr, "kvctl: warning: "+w)
	}
	for _, r := range rows {
		switch {
		case r.Status == nil || !r.Removed:
		case r.Status.Removed:
			fmt.Fprintf(e.stderr, "kvctl: warning: %s (%s) was removed from the cluster and no longer follows it: stop its process (docs/operations.md, \"Remove a node\")\n",
				orDash(r.Status.ID), r.Endpoint)
		default:
			fmt.Fprintf(e.stderr, "kvctl: warning: %s (%s) was removed from the cluster: the leader %s's configuration leaves it out, "+
				"and it knows no leader (it may not know it was removed, and stands for election, which the members refuse): "+
				"stop its process (docs/operations.md, \"Remove a node\")\n",
				r.Status.ID, r.Endpoint, leader.id)
		}
	}
	for _, r := range rows {
		if r.Status != nil && r.Status.ApplyHalted != "" {
			fmt.Fprintf(e.stderr, "kvctl: warning: %s (%s): %s: it applies nothing, and is not ready, until it is restarted on a build that reads the entry (docs/operations.md, \"Upgrade\")\n",
				orDash(r.Status.ID), r.Endpoint, r.Status.ApplyHalted)
		}
	}
	for _, r := range rows {
		if r.Status == nil || r.Status.NATS != "disconnected" || r.Removed {
			continue
		}
		// Only the leader ingests the agents' events; a follower without
		// NATS matters when it takes over.
		role := "it ingests nothing until it reconnects, should it take over"
		if r.Status.State == "Leader" {
			role = "it leads, so no agent's events are ingested until it reconnects or another node leads (it hands the leadership to a node connected to NATS after its --nats-handover-after; kvctl leader transfer moves it now)"
		}
		fmt.Fprintf(e.stderr, "kvctl: warning: %s (%s) is not connected to NATS: %s (docs/operations.md, \"What to watch\")\n",
			orDash(r.Status.ID), r.Endpoint, role)
	}
	switch {
	case answered != nil:
		// Wrapped, for explain to say what to do (give the token, the CA).
		return fmt.Errorf("%d of %d endpoints failed: %w", failed, len(rows), answered)
	case failed > 0:
		return fmt.Errorf("%d of %d endpoints did not answer; check that those nodes run and that --endpoints names them right",
			failed, len(rows))
	}
	return nil
}

// leaderConfig is the members of the leader's latest Raft configuration,
// as the leader answered them, by id.
type leaderConfig struct {
	id      string
	members map[string]raftfsm.Member
}

// leaderMembers asks the leader among the status answers (of the highest
// term, should two answer as leaders) for its members, after every
// status came: a node a status named had been added by then, and is in
// the list unless removed since. Nil, and so no claim of a removal, when
// no leader answered, or its members did not come, or it no longer leads
// by then (a list without it as the leader).
func leaderMembers(ctx context.Context, c *cli.Context, res []client.EndpointStatus) *leaderConfig {
	var leader *client.EndpointStatus
	for i, r := range res {
		if st := r.Status; st != nil && st.State == "Leader" && st.ID != "" && (leader == nil || st.Term > leader.Status.Term) {
			leader = &res[i]
		}
	}
	if leader == nil {
		return nil
	}
	one, err := newClientWith(c, []string{leader.Endpoint}, attemptTimeout(c), attemptTimeout(c))
	if err != nil {
		return nil
	}
	defer one.Close()
	ctx, cancel := context.WithTimeout(ctx, attemptTimeout(c))
	defer cancel()
	ms, err := one.Members(ctx)
	if err != nil {
		return nil
	}
	lc := &leaderConfig{id: leader.Status.ID, members: map[string]raftfsm.Member{}}
	for _, m := range ms {
		lc.members[m.ID] = m
	}
	if m, ok := lc.members[lc.id]; !ok || !m.Leader {
		return nil
	}
	return lc
}

// leftOut reports whether the leader's configuration leaves out the node
// of st, which does not know it: a removed follower that never got the
// entry removing it (the leader stopped replicating to it first) keeps
// its own configuration, which names it, and stands for election, a
// Candidate with no leader whose pre-votes the members refuse. Only a
// node that knows no leader (a leader replicates only to its
// configuration's servers, which a node it reaches is, or is about to
// be) and holds a log (a node started with --join that was not added yet
// has none): not one just added, or not yet. A node the leader lists
// under its id at another Raft address is another process than the
// member (its old address, before it was removed and added at a new
// one): each node reports its own Raft address, and starts only at the
// one its configuration names. A node with no id is no claim.
func (lc *leaderConfig) leftOut(st *raftfsm.NodeStatus) bool {
	if lc == nil || st.ID == "" || st.ID == lc.id || st.LeaderID != "" || st.LastIndex == 0 {
		return false
	}
	m, ok := lc.members[st.ID]
	return !ok || st.RaftAddr != "" && !raftfsm.SameRaftAddr(m.RaftAddr, st.RaftAddr)
}

// failedNotUnreachable reports whether err is an endpoint that was reached
// and failed: it answered with an error (a 401 for want of the token), or
// with what is not a node's status (notAStatus), or its TLS did not match
// kvctl's (a certificate kvctl refused, plain HTTP to --tls-ca). kvctl's
// own settings may be at fault, and explain says which; any other error
// is an endpoint that did not answer.
func failedNotUnreachable(err error) bool {
	var ae *client.Error
	var ve *tls.CertificateVerificationError
	return errors.As(err, &ae) || errors.As(err, &ve) || notAStatus(err) ||
		strings.Contains(err.Error(), "server gave HTTP response to HTTPS client")
}

// notAStatus reports whether err is an answer that is not a node's
// status: a success answer not JSON, JSON of another shape (a value not
// an object, or an object with none of a status's fields:
// client.ErrNotAnAnswer), or larger
// than any status (another service at that address: a web page, a metrics
// port), or no HTTP at all (client.ErrNotHTTP: a service of another
// protocol, a node's NATS port). The endpoint answered: "did not answer"
// would send the operator after a process that runs.
func notAStatus(err error) bool {
	var se *json.SyntaxError
	var te *json.UnmarshalTypeError
	return errors.As(err, &se) || errors.As(err, &te) || errors.Is(err, client.ErrAnswerTooLarge) ||
		errors.Is(err, client.ErrNotHTTP) || errors.Is(err, client.ErrNotAnAnswer)
}

// divergence reports endpoints that are nodes of different clusters
// (their confirmed cluster ids differ), and replicas of one cluster that
// applied the same index but hold different states: the digests are
// equal on replicas at equal applied index unless they diverged. A node
// of no cluster id (a build or directory before them), or of a
// provisional one (unconfirmed: it may not be its cluster's), is taken
// for any cluster's.
func divergence(rows []statusRow) []string {
	var out []string
	clusterOf := func(s *raftfsm.NodeStatus) string {
		if s.ClusterIDProvisional {
			return ""
		}
		return s.ClusterID
	}
	clusters := map[string][]string{} // cluster id -> ids
	for _, r := range rows {
		if s := r.Status; s != nil && clusterOf(s) != "" {
			clusters[s.ClusterID] = append(clusters[s.ClusterID], orDash(s.ID)+" ("+r.Endpoint+")")
		}
	}
	if len(clusters) > 1 {
		var parts []string
		for c, ids := range clusters {
			parts = append(parts, strings.Join(ids, ", ")+" of cluster "+c)
		}
		slices.Sort(parts)
		out = append(out, fmt.Sprintf("the endpoints are nodes of %d clusters (%s): check --endpoints", len(clusters), strings.Join(parts, "; ")))
	}
	type at struct {
		cluster string
		applied uint64
	}
	byIndex := map[at]map[string][]string{} // (cluster, applied) -> digest -> ids
	for _, r := range rows {
		if s := r.Status; s != nil && s.Digest != "" {
			k := at{"", s.AppliedIndex}
			if len(clusters) > 1 {
				k.cluster = clusterOf(s)
			}
			if byIndex[k] == nil {
				byIndex[k] = map[string][]string{}
			}
			byIndex[k][s.Digest] = append(byIndex[k][s.Digest], orDash(s.ID))
		}
	}
	for k, digests := range byIndex {
		idx := k.applied
		if len(digests) < 2 {
			continue
		}
		var parts []string
		for d, ids := range digests {
			parts = append(parts, strings.Join(ids, ",")+" has "+d)
		}
		slices.Sort(parts)
		out = append(out, fmt.Sprintf("different state digests at applied index %d (%s): the replicas diverged; see the nodes' logs",
			idx, strings.Join(parts, "; ")))
	}
	slices.Sort(out)
	return out
}

func hostOf(base string) string {
	if u, err := url.Parse(base); err == nil && u.Host != "" {
		return u.Host
	}
	return base
}

// shortError is an error without the request in front, for a table cell.
func shortError(err error) string {
	var ae *client.Error
	if errors.As(err, &ae) {
		if ae.Reason == "" && ae.StatusCode/100 != 3 {
			// No node's error: another server's page (a 404's HTML).
			return fmt.Sprintf("HTTP %d: %s", ae.StatusCode, client.AnswerExcerpt(ae.Message, ae.StatusCode))
		}
		return fmt.Sprintf("HTTP %d %s", ae.StatusCode, oneLine(ae.Message))
	}
	s := err.Error()
	if i := strings.LastIndex(s, ": "); i >= 0 && errors.Is(err, client.ErrUnreachable) {
		s = s[i+2:]
	}
	return oneLine(s)
}

func membersCommand(e *env) *cli.Command {
	return &cli.Command{
		Name:  "members",
		Usage: "list, add or remove cluster members",
		Description: "Example:\n" +
			"   kvctl members list\n" +
			"   kvctl members add n4 10.0.0.4:7000 10.0.0.4:7080\n" +
			"   kvctl members remove n4",
		Action: group("list, add or remove"),
		Subcommands: []*cli.Command{
			{
				Name:  "list",
				Usage: "list the members: the Raft configuration's servers, with their HTTP addresses from the member table",
				Description: "The view of the leader, or of a node that knows it (asked first: the endpoints' statuses\n" +
					"say which): the servers of its latest Raft configuration (committed or not), each with its\n" +
					"Raft address and whether it votes and leads, and its HTTP address from the replicated\n" +
					"member table (- when the table has no entry for it yet). When no node that answers knows a\n" +
					"leader, the first answer's view, with a warning that it may be stale.\n\n" +
					"Example:\n   kvctl members list -o json",
				Action: func(c *cli.Context) error {
					if err := args(c, 0, "no arguments"); err != nil {
						return err
					}
					return withClient(c, func(ctx context.Context, cl *client.Client) error {
						view, done, err := viewClient(ctx, c, cl)
						if err != nil {
							return err
						}
						defer done()
						ms, err := view.Members(ctx)
						if err != nil {
							return err
						}
						if jsonOut(c) {
							return writeJSON(e.stdout, ms)
						}
						t := newTable(e.stdout, "ID", "RAFT_ADDR", "HTTP_ADDR", "VOTER", "LEADER")
						for _, m := range ms {
							t.row(m.ID, m.RaftAddr, orDash(m.HTTPAddr), yesNo(m.Voter), yesNo(m.Leader))
						}
						return t.flush()
					})
				},
			},
			{
				Name:      "add",
				Usage:     "add a voter: its id, Raft address and HTTP address",
				ArgsUsage: "ID RAFTADDR HTTPADDR",
				Description: "The call behind kvrouter --join, which makes it for the node it starts: start new\n" +
					"nodes with --join (a node started without --join or --peers is a cluster of its own,\n" +
					"and refuses another cluster's leader once added here). The node is a non-voter until it\n" +
					"has caught up, and the add waits for that: when --timeout ends first it exits 1 and the\n" +
					"node may stay a non-voter (members list: VOTER no); add it again once it runs (which\n" +
					"resumes the wait), or remove it. RAFTADDR is the new node's own, as its peers dial it:\n" +
					"a wildcard host (0.0.0.0), port 0, or another spelling of a member's address (localhost\n" +
					"for 127.0.0.1) is refused. HTTPADDR is the address the other nodes reach its API at\n" +
					"(its kvrouter --http-advertise): a wildcard host or port 0 is refused.\n\n" +
					"Example:\n   kvctl members add n4 10.0.0.4:7000 10.0.0.4:7080",
				Action: func(c *cli.Context) error {
					if err := args(c, 3, "ID RAFTADDR HTTPADDR"); err != nil {
						return err
					}
					id, raftAddr, httpAddr := c.Args().Get(0), c.Args().Get(1), c.Args().Get(2)
					return withClient(c, func(ctx context.Context, cl *client.Client) error {
						if err := cl.AddMember(ctx, id, raftAddr, httpAddr); err != nil {
							if errors.Is(err, context.DeadlineExceeded) {
								return fmt.Errorf("%w (%s may have been added as a non-voter that has not caught up: "+
									"kvctl members list shows VOTER no; add it again once it runs, or remove it)", err, id)
							}
							return err
						}
						m := raftfsm.Member{ID: id, RaftAddr: raftAddr, HTTPAddr: httpAddr, Voter: true}
						if jsonOut(c) {
							return writeJSON(e.stdout, map[string]any{"added": m})
						}
						_, err := fmt.Fprintf(e.stdout, "added member %s (raft %s, http %s)\n", id, raftAddr, httpAddr)
						return err
					})
				},
			},
			{
				Name:        "remove",
				Usage:       "remove a member",
				ArgsUsage:   "ID",
				Description: "Example:\n   kvctl members remove n4",
				Action: func(c *cli.Context) error {
					if err := args(c, 1, "ID"); err != nil {
						return err
					}
					id := c.Args().First()
					return withClient(c, func(ctx context.Context, cl *client.Client) error {
						if err := cl.RemoveMember(ctx, id); err != nil {
							// invalid here is an id that names no member (or
							// the last voter): the list shows the ids.
							return withReasonHint(err, api.ReasonInvalid, "kvctl members list shows the members' ids")
						}
						if jsonOut(c) {
							return writeJSON(e.stdout, map[string]string{"removed": id})
						}
						_, err := fmt.Fprintf(e.stdout, "removed member %s\n", id)
						return err
					})
				},
			},
		},
	}
}

func leaderCommand(e *env) *cli.Command {
	return &cli.Command{
		Name:        "leader",
		Usage:       "move leadership",
		Description: "Example:\n   kvctl leader transfer --to n2",
		Action:      group("transfer"),
		Subcommands: []*cli.Command{{
			Name:  "transfer",
			Usage: "hand leadership to another voter (before maintenance of the leader)",
			Description: "Without --to, any up-to-date voter takes over. kvctl waits, within --timeout, until a node\n" +
				"names the new leader, and prints it; --to a member that is not a voter is refused, and\n" +
				"another voter taking over than --to names is an error (exit 1).\n\n" +
				"Example:\n   kvctl leader transfer\n   kvctl leader transfer --to n2",
			Flags: []cli.Flag{&cli.StringFlag{Name: "to", Usage: "the member `ID` to hand leadership to"}},
			Action: func(c *cli.Context) error {
				if err := args(c, 0, "no arguments (the target is --to ID)"); err != nil {
					return err
				}
				to := c.String("to")
				if to == "" && c.IsSet("to") {
					// --to "$NODE" with the variable unset: leaving --to
					// out, not this, hands leadership to any voter.
					return usagef("--to is empty: give the member ID to hand leadership to (or leave --to out, for any voter)")
				}
				return withClient(c, func(ctx context.Context, cl *client.Client) error {
					// Who leads now, and in what term: the one that takes
					// over is another, in a later term. Printed is the one
					// a node names, not the one asked for: the transfer
					// returns once the old leader stepped down.
					round := statusRound(c)
					before, _, err := leaderView(ctx, c, cl)
					if err != nil {
						return err
					}
					if err := cl.TransferLeader(ctx, to); err != nil {
						return err
					}
					leader, err := newLeader(ctx, cl, before, c.Duration("timeout"), round)
					if err != nil {
						return err
					}
					if to != "" && leader != to {
						return fmt.Errorf("leadership transfer: %s took over, not %s; kvctl status shows the leader", leader, to)
					}
					if jsonOut(c) {
						return writeJSON(e.stdout, map[string]string{"leader": leader})
					}
					_, err = fmt.Fprintf(e.stdout, "leadership transferred to %s\n", leader)
					return err
				})
			},
		}},
	}
}

// leaderView returns the status that knows best who leads now: of the
// endpoints' answers, the one of the highest term that names a leader, the
// leader's own first among those of that term. Not the first endpoint's
// answer: a node restarted, or cut off, knows no leader or an older term,
// and newLeader, measuring against it, would take the leader that hands
// over, still named by a follower, for the new one. With no answer naming
// a leader, it is the first answer. ep is the endpoint that gave it, as
// --endpoints names it; empty when none answered within its share and
// Status's answer stands in.
//
// It waits, each endpoint within its share (attemptTimeout), until the
// leader's own answer or a majority of the endpoints' came, or every
// endpoint's: not a round's answers alone, since a busy leader and
// follower slower than a round left only a stale node's view, and kvctl
// named the leader that handed over as the new one; nor every endpoint's,
// since a hung one then held the transfer for all of a --timeout of 2 s.
// The transfer has not been sent yet, so waiting here costs nothing else.
func leaderView(ctx context.Context, c *cli.Context, cl *client.Client) (best *raftfsm.NodeStatus, ep string, err error) {
	eps := endpointsArg(c)
	wctx, cancel := context.WithTimeout(ctx, attemptTimeout(c))
	defer cancel()
	// One client per endpoint, to see each answer as it comes: StatusAll
	// returns only once every endpoint has answered.
	answers := make(chan client.EndpointStatus, len(eps))
	for _, ep := range eps {
		go func() {
			one, err := newClientWith(c, []string{ep}, attemptTimeout(c), attemptTimeout(c))
			if err != nil {
				answers <- client.EndpointStatus{Endpoint: ep, Err: err}
				return
			}
			defer one.Close()
			a := one.StatusAll(wctx)[0]
			a.Endpoint = ep
			answers <- a
		}()
	}
	statuses := 0
wait:
	for range eps {
		var a client.EndpointStatus
		select {
		case a = <-answers:
		case <-wctx.Done():
			break wait
		}
		st := a.Status
		if st != nil {
			statuses++
		}
		switch {
		case st == nil:
		case best == nil:
			best, ep = st, a.Endpoint
		case st.LeaderID == "":
		case best.LeaderID == "", st.Term > best.Term,
			st.Term == best.Term && st.State == "Leader" && best.State != "Leader":
			best, ep = st, a.Endpoint
		}
		if best != nil && (best.State == "Leader" && best.LeaderID != "" || statuses > len(eps)/2) {
			break wait
		}
	}
	if best == nil {
		// None answered: Status's error is the one every command gives.
		best, err = cl.Status(ctx)
		return best, "", err
	}
	return best, ep, nil
}

// viewClient returns a client for a read of the cluster's view (members,
// workers) that asks first the node that knows best who leads
// (leaderView): the leader, or a node that knows it, and then the others
// in --endpoints' order. Not the first endpoint that answers: a node with
// no leader may hold a stale view, a removed follower that never got the
// entry removing it most of all (its configuration lacks the members
// added since and lists it as a voter). When no node that answered knows
// a leader, the view is the first answer's, with a warning that it may be
// stale. done closes the client.
func viewClient(ctx context.Context, c *cli.Context, cl *client.Client) (view *client.Client, done func(), err error) {
	best, ep, err := leaderView(ctx, c, cl)
	if err != nil {
		return nil, nil, err
	}
	if best.LeaderID == "" {
		fmt.Fprintf(c.App.ErrWriter, "kvctl: warning: no node that answered knows a leader: this is %s's view, which may be stale "+
			"(a node cut off, or removed from the cluster without knowing it); kvctl status shows each node\n", orDash(best.ID))
	}
	if ep == "" {
		return cl, func() {}, nil
	}
	order := []string{ep}
	for _, other := range endpointsArg(c) {
		if other != ep {
			order = append(order, other)
		}
	}
	view, err = newClientWith(c, order, attemptTimeout(c), attemptTimeout(c))
	if err != nil {
		return nil, nil, err
	}
	return view, func() { view.Close() }, nil
}

// newLeader waits, within ctx, until a node names a leader that took over
// from the one in before: another node, in a later term. The transfer
// returns once the old leader has stepped down, when it and most
// followers have often not heard from the new one yet, so every endpoint
// is asked (the new leader knows at once), each round within round, until
// one names it.
func newLeader(ctx context.Context, cl *client.Client, before *raftfsm.NodeStatus, timeout, round time.Duration) (string, error) {
	const poll = 50 * time.Millisecond
	t := time.NewTimer(0)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			old := before.LeaderID
			if old == "" {
				old = "the leader"
			}
			if !errors.Is(ctx.Err(), context.DeadlineExceeded) {
				return "", fmt.Errorf("leadership transfer: %s stepped down; waiting for the new leader: %w", old, ctx.Err())
			}
			// Not ctx's error: the transfer went through, and withClient's
			// "no answer within --timeout" would say otherwise.
			return "", fmt.Errorf("leadership transfer: %s stepped down, but no node named a new leader within --timeout %v "+
				"(is a quorum of voters up?); kvctl status shows the leader once one is elected", old, timeout)
		case <-t.C:
		}
		for _, a := range statusesWithin(ctx, cl, round) {
			if st := a.Status; st != nil && st.LeaderID != "" && st.LeaderID != before.LeaderID && st.Term > before.Term {
				return st.LeaderID, nil
			}
		}
		t.Reset(poll)
	}
}

// statusRound bounds one round of leader transfer's questions to every
// endpoint (statusesWithin): a quarter of --timeout, at most a try's
// share (attemptTimeout).
func statusRound(c *cli.Context) time.Duration {
	return min(attemptTimeout(c), c.Duration("timeout")/4)
}

// statusesWithin asks every endpoint for its status and returns what came
// within round; an endpoint that had not answered by then has an error.
// Not StatusAll alone: it waits for every endpoint, and one that accepts
// connections and never answers (hung, stopped) held each round for a
// try's share of --timeout (all of a --timeout of 2 s), so that the
// transfer was never sent, or its new leader never seen.
func statusesWithin(ctx context.Context, cl *client.Client, round time.Duration) []client.EndpointStatus {
	ctx, cancel := context.WithTimeout(ctx, round)
	defer cancel()
	return cl.StatusAll(ctx)
}
