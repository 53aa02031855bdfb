package main

import (
	"bytes"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/kvrouter/kvrouter/api"
	"github.com/kvrouter/kvrouter/api/client"
	"github.com/kvrouter/kvrouter/internal/doccheck"
	"github.com/kvrouter/kvrouter/kvevent"
	"github.com/kvrouter/kvrouter/raftfsm"
)

// tableCells reads a table kvctl printed into one map per row, each
// cell under its header's name, by the columns' positions (a cell may be
// empty, as route's mark of a candidate not chosen is). The first
// column's header may be empty: it is named "".
func tableCells(t *testing.T, out string) []map[string]string {
	t.Helper()
	lines := strings.Split(strings.TrimRight(out, "\n"), "\n")
	head := lines[0]
	var names []string
	var starts []int
	for i := 0; i < len(head); {
		if head[i] == ' ' {
			i++
			continue
		}
		j := i
		for j < len(head) && head[j] != ' ' {
			j++
		}
		names, starts = append(names, head[i:j]), append(starts, i)
		i = j
	}
	if len(starts) > 0 && starts[0] > 0 { // an empty first header
		names, starts = append([]string{""}, names...), append([]int{0}, starts...)
	}
	var rows []map[string]string
	for _, l := range lines[1:] {
		row := map[string]string{}
		for k, s := range starts {
			end := len(l)
			if k+1 < len(starts) && starts[k+1] < end {
				end = starts[k+1]
			}
			if s < len(l) {
				row[names[k]] = strings.TrimSpace(l[s:end])
			}
		}
		rows = append(rows, row)
	}
	return rows
}

// TestTableCellsHoldTheirOwnFigures pins the values of table cells, not
// only their headers (docs/kvctl.md): route's CREDIT and PREFILL_BLOCKS,
// workers --tier host's HOST, snapshot inspect's format version and
// status's COMMIT and APPLIED each show their own figure. From a review:
// swapping any pair, or printing the device count under HOST, passed
// every test.
func TestTableCellsHoldTheirOwnFigures(t *testing.T) {
	t.Run("route", func(t *testing.T) {
		var out bytes.Buffer
		err := printCandidates(&env{stdout: &out, stderr: io.Discard}, []api.Candidate{
			{WorkerID: 7, DPRank: 1, Chosen: true, Credit: 3.5, PrefillBlocks: 12, PotentialDecodeBlocks: 4,
				Overlap: api.TierBlocks{Device: 5, Host: 6, Disk: 8, External: 9}, ActiveRequests: 2, ActivePrefillTokens: 30, Cost: 11.25},
		}, 0)
		if err != nil {
			t.Fatal(err)
		}
		rows := tableCells(t, out.String())
		want := map[string]string{"": "*", "WORKER": "7", "DP": "1", "DEVICE": "5", "HOST": "6", "DISK": "8", "EXTERNAL": "9",
			"CREDIT": num(3.5), "PREFILL_BLOCKS": num(12), "DECODE_BLOCKS": "4", "REQUESTS": "2", "PREFILL_TOKENS": "30",
			"COST": num(11.25)}
		for k, v := range want {
			if rows[0][k] != v {
				t.Errorf("route's %s cell = %q, want %q:\n%s", k, rows[0][k], v, out.String())
			}
		}
	})
	t.Run("workers --tier host", func(t *testing.T) {
		host, err := kvevent.ParseTier("host")
		if err != nil {
			t.Fatal(err)
		}
		var out bytes.Buffer
		ws := []api.Worker{{WorkerID: 4, BlockSize: 16, Model: "llama",
			Ranks: []api.RankInfo{{DPRank: 0, Blocks: api.TierBlocks{Device: 100, Host: 200, Disk: 300, External: 400}}}}}
		if err := printWorkers(&env{stdout: &out, stderr: io.Discard}, ws, []kvevent.Tier{host}); err != nil {
			t.Fatal(err)
		}
		rows := tableCells(t, out.String())
		if rows[0]["HOST"] != "200" {
			t.Errorf("workers --tier host: HOST = %q, want the host count 200:\n%s", rows[0]["HOST"], out.String())
		}
	})
	t.Run("snapshot inspect", func(t *testing.T) {
		file := filepath.Join(t.TempDir(), "a.snap")
		if err := os.WriteFile(file, []byte("x"), 0o644); err != nil {
			t.Fatal(err)
		}
		h := &harness{inspect: func(r io.Reader) (raftfsm.SnapshotInfo, error) {
			_, _ = io.Copy(io.Discard, r)
			return raftfsm.SnapshotInfo{FormatVersion: 7, Index: 41, Term: 3, Bytes: 1}, nil
		}}
		r := h.run(t, "snapshot", "inspect", file).wantCode(t, 0)
		// A table without a header: each row is a name, then its value.
		got := map[string]string{}
		for _, l := range strings.Split(strings.TrimRight(r.stdout, "\n"), "\n") {
			if name, val, ok := strings.Cut(l, "  "); ok {
				got[name] = strings.TrimSpace(val)
			}
		}
		for name, val := range map[string]string{"format version": "7", "index": "41", "term": "3"} {
			if got[name] != val {
				t.Errorf("snapshot inspect: the %s row reads %q, want %s:\n%s", name, got[name], val, r.stdout)
			}
		}
	})
	t.Run("status", func(t *testing.T) {
		c := newCluster(t)
		st := c.nodes[0].fake.Status()
		st.CommitIndex, st.AppliedIndex = 35, 33
		c.nodes[0].fake.SetStatus(st)
		r := kvctl(t, "--endpoints", c.nodes[0].addr(), "status").wantCode(t, 0)
		rows := tableCells(t, r.stdout)
		if rows[0]["COMMIT"] != "35" || rows[0]["APPLIED"] != "33" {
			t.Errorf("status: COMMIT %q, APPLIED %q; want 35 and 33:\n%s", rows[0]["COMMIT"], rows[0]["APPLIED"], r.stdout)
		}
	})
}

// TestMembersListShowsVoterAndAnUnknownHTTPAddress pins members list's
// cells (docs/kvctl.md): VOTER reads no for a non-voter and yes for a
// voter, and HTTP_ADDR reads - for a member the member table has no
// address for yet.
func TestMembersListShowsVoterAndAnUnknownHTTPAddress(t *testing.T) {
	c := newCluster(t)
	ms := []raftfsm.Member{
		{ID: "n1", RaftAddr: "n1:7946", HTTPAddr: c.nodes[0].addr(), Voter: true, Leader: true},
		{ID: "n4", RaftAddr: "n4:7946", Voter: false},
	}
	for _, n := range c.nodes {
		n.fake.SetMembers(ms)
	}
	r := kvctl(t, "--endpoints", c.nodes[0].addr(), "members", "list").wantCode(t, 0)
	rows := tableCells(t, r.stdout)
	if len(rows) != 2 {
		t.Fatalf("members list: %d rows, want 2:\n%s", len(rows), r.stdout)
	}
	want := []map[string]string{
		{"ID": "n1", "HTTP_ADDR": c.nodes[0].addr(), "VOTER": "yes", "LEADER": "yes"},
		{"ID": "n4", "RAFT_ADDR": "n4:7946", "HTTP_ADDR": "-", "VOTER": "no", "LEADER": "no"},
	}
	for i, w := range want {
		for k, v := range w {
			if rows[i][k] != v {
				t.Errorf("members list row %d: %s = %q, want %q:\n%s", i, k, rows[i][k], v, r.stdout)
			}
		}
	}
}

// TestEveryErrorCodeGetsItsHint pins what explain adds to a node's error
// answer of each reason (docs/kvctl.md: errors say what to do): each
// reason its own hint, none left without one. Every reason api/errors.go
// declares (read from the source, doccheck.Reasons) is in the table or
// in noHint, so that a reason added there cannot go without one
// unnoticed. From a review: ten reasons had none (kvctl members remove
// zz printed 'no member "zz" (HTTP 400, invalid)' and nothing after).
func TestEveryErrorCodeGetsItsHint(t *testing.T) {
	// noHint: the reasons whose answer needs no hint after it; none now.
	// A reason goes here only with a comment saying why.
	noHint := map[string]bool{}
	hints := map[string]string{
		api.ReasonNoWorkers:           "no worker can take requests: register workers first (kvctl workers lists them)",
		api.ReasonUnknownWorker:       "kvctl workers lists the registered workers",
		api.ReasonBadSnapshot:         "the file is damaged or not a snapshot: take a new one with kvctl snapshot save",
		api.ReasonShuttingDown:        "the node is stopping: use another endpoint",
		api.ReasonUnreachable:         "nothing changed: kvctl status on that member shows whether it is up",
		api.ReasonNotReady:            "the node is starting or catching up: retry, or use another endpoint",
		api.ReasonInternal:            "see the node's log",
		api.ReasonNoLeader:            "the cluster has no leader right now: check kvctl status and retry (a cluster that lost a majority of its members for good elects none: see Majority lost in docs/operations.md)",
		api.ReasonOverloaded:          "every rank is busy: retry later, add workers or raise the busy thresholds",
		api.ReasonInsufficientStorage: "nothing was installed: free space on the leader's data directory (kvctl status names the leader) and restore again",
		api.ReasonTimeout:             "the write may still apply: check with kvctl status (and kvctl members list) before retrying it",
		api.ReasonStateReplaced:       "retry the save: it reads the restored state",
		api.ReasonTooLarge:            "the request is larger than the node takes",
		api.ReasonBadJSON:             "the node does not take this request: use a kvctl of the nodes' release",
		api.ReasonNotFound:            "the node does not take this request: use a kvctl of the nodes' release",
		api.ReasonMethodNotAllowed:    "the node does not take this request: use a kvctl of the nodes' release",
		api.ReasonInvalid:             "nothing changed: correct the value the message names (kvctl help shows the command's arguments)",
		api.ReasonUnknownRank:         "kvctl workers lists the registered workers and their ranks",
		api.ReasonUnregisteredRank:    "kvctl workers lists the registered workers and their ranks",
		api.ReasonStaleDump:           "nothing applied: the rank's events are newer than the dump, take a new one",
		api.ReasonConflict:            "nothing changed: kvctl workers lists the registered workers",
		api.ReasonRequestTimeout:      "nothing applied: the request's body reached the node too slowly, send it again",
		api.ReasonCanceled:            "the node's work was cut off: retry",
		// unauthorized: explain's hint for client.ErrUnauthorized.
		api.ReasonUnauthorized: "give the cluster's token with --token or --token-file (or KVCTL_TOKEN)",
	}
	for reason, hint := range hints {
		err := &client.Error{Endpoint: "http://n1:7080", StatusCode: 503, Reason: reason, Message: "it failed"}
		if reason == api.ReasonUnauthorized {
			err.StatusCode = http.StatusUnauthorized
		}
		// As a command returns it: wrapped.
		if got, want := explain(fmt.Errorf("workers: %w", err)), "workers: "+err.Error()+"; "+hint; got != want {
			t.Errorf("%s: explain = %q, want %q", reason, got, want)
		}
	}
	for reason := range doccheck.Reasons(t, "../../api") {
		if _, ok := hints[reason]; !ok && !noHint[reason] {
			t.Errorf("reason %q (api/errors.go) has no hint in explain, and is not in noHint with why it needs none", reason)
		}
	}
}
