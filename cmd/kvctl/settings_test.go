package main

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/kvrouter/kvrouter/api"
	"github.com/kvrouter/kvrouter/indexer"
	"github.com/kvrouter/kvrouter/raftfsm"
)

// TestSettingsShowsTheClustersSettings: kvctl settings shows every
// scoring setting the answering node holds, as a table or (-o json) as
// the body of PUT /v1/settings.
func TestSettingsShowsTheClustersSettings(t *testing.T) {
	c := newCluster(t)
	p := indexer.DefaultParams()
	p.Temperature, p.BusyPrefillTokens = 0.25, 4096
	if err := c.leader().SetSettings(context.Background(), raftfsm.Settings{Params: p, View: indexer.ViewTiered}); err != nil {
		t.Fatal(err)
	}
	r := kvctl(t, "--endpoints", c.endpoints(), "settings").wantCode(t, 0)
	for _, row := range [][]string{{"SETTING", "VALUE"}, {"overlap_score_credit", "1"}, {"host_cache_hit_weight", "0.75"},
		{"temperature", "0.25"}, {"busy_decode_fraction", "0"}, {"busy_prefill_tokens", "4096"}, {"view", "tiered"}} {
		if !strings.Contains(r.stdout, "\n"+strings.Join(row, " ")) && !containsFields(r.stdout, row) {
			t.Errorf("kvctl settings lacks the row %q:\n%s", row, r.stdout)
		}
	}
	r = kvctl(t, "--endpoints", c.endpoints(), "settings", "-o", "json").wantCode(t, 0)
	var got api.SettingsRequest
	if err := json.Unmarshal([]byte(r.stdout), &got); err != nil || got.Params == nil || *got.Params != p || got.View != "tiered" {
		t.Fatalf("kvctl settings -o json: %v %s", err, r.stdout)
	}
}

// containsFields reports whether a line of out has the fields of row.
func containsFields(out string, row []string) bool {
	for line := range strings.SplitSeq(out, "\n") {
		if strings.Join(strings.Fields(line), " ") == strings.Join(row, " ") {
			return true
		}
	}
	return false
}

// TestSettingsSetKeepsTheOthers: kvctl settings set changes the settings
// its flags give and keeps every other one (PUT /v1/settings would reset
// those it is not given to the defaults), on the leader through a
// follower's forward; a command line without a setting, or with a value
// that is none, is a usage error (exit 2) that changes nothing.
func TestSettingsSetKeepsTheOthers(t *testing.T) {
	c := newCluster(t)
	p := indexer.DefaultParams()
	p.PrefillLoadScale, p.BusyDecodeFraction = 3, 0.5
	if err := c.leader().SetSettings(context.Background(), raftfsm.Settings{Params: p, View: indexer.ViewDedup}); err != nil {
		t.Fatal(err)
	}
	r := kvctl(t, "--endpoints", c.endpoints(), "settings", "set", "--temperature", "0.2", "--busy-prefill-tokens", "500", "--view", "tiered").wantCode(t, 0)
	want := p
	want.Temperature, want.BusyPrefillTokens = 0.2, 500
	if got := c.leader().Settings(); got.Params != want || got.View != indexer.ViewTiered {
		t.Fatalf("after settings set: %+v, want %+v (tiered)", got, want)
	}
	if !containsFields(r.stdout, []string{"prefill_load_scale", "3"}) || !containsFields(r.stdout, []string{"temperature", "0.2"}) {
		t.Fatalf("settings set shows:\n%s", r.stdout)
	}
	for _, bad := range [][]string{
		{"settings", "set"},
		{"settings", "set", "--temperature", "abc"},
		{"settings", "set", "--temperature", "NaN"},
		{"settings", "set", "--overlap-score-credit", "-1"},
		{"settings", "set", "--busy-prefill-tokens", "1.5"},
		{"settings", "set", "--view", "fancy"},
		{"settings", "set", "--temperature", "1", "extra"},
		{"settings", "show"},
	} {
		r := kvctl(t, append([]string{"--endpoints", c.endpoints()}, bad...)...).wantCode(t, 2)
		if r.stdout != "" {
			t.Errorf("%q wrote to stdout: %s", bad, r.stdout)
		}
		if got := c.leader().Settings(); got.Params != want || got.View != indexer.ViewTiered {
			t.Fatalf("%q changed the settings: %+v", bad, got)
		}
	}
}

// TestSettingsSetThroughAStaleNodeKeepsAnAcknowledgedChange: kvctl
// settings set reads the settings and puts them all back with its flags'
// fields changed. Its first endpoint a follower whose state lacks a
// change the leader acknowledged (temperature 0.5), its read goes to the
// leader (GET /v1/settings?consistent=true), or the put would revert that
// change for good; and a leader just elected, not caught up, is passed
// over (503 no_leader) rather than read.
func TestSettingsSetThroughAStaleNodeKeepsAnAcknowledgedChange(t *testing.T) {
	c := newCluster(t)
	p := indexer.DefaultParams()
	p.Temperature = 0.5
	if err := c.leader().SetSettings(context.Background(), raftfsm.Settings{Params: p}); err != nil {
		t.Fatal(err)
	}
	stale := c.nodes[1].addr()
	kvctl(t, "--endpoints", stale+","+c.nodes[0].addr(), "settings", "set", "--busy-prefill-tokens", "100").wantCode(t, 0)
	want := p
	want.BusyPrefillTokens = 100
	if got := c.leader().Settings(); got.Params != want {
		t.Fatalf("after the acknowledged temperature 0.5 and a settings set of busy_prefill_tokens 100 through the stale "+
			"follower: temperature %v, busy_prefill_tokens %d, want 0.5 and 100 (the follower's settings were put back)",
			got.Params.Temperature, got.Params.BusyPrefillTokens)
	}
	c.leader().SetHook(func(method string) error {
		if method == "CheckLeader" {
			return fmt.Errorf("%w: this node was just elected and has not yet applied every entry of the terms before its own; retry", raftfsm.ErrNoLeader)
		}
		return nil
	})
	kvctl(t, "--endpoints", c.nodes[0].addr(), "settings", "set", "--temperature", "0.25").wantCode(t, 1)
	if got := c.leader().Settings(); got.Params != want {
		t.Fatalf("a settings set answered by a leader not caught up changed the settings: %+v, want %+v", got.Params, want)
	}
}

// TestSettingsOnAnOlderBuildSaysWhatToDo pins design/cli.md's "Errors
// go to stderr, one line, saying what to do" for kvctl settings (and
// settings set) answered by a node of a build before GET /v1/settings,
// which answers it 405 method_not_allowed (allowed: PUT), as
// docs/operations.md's Upgrade notes say ("A node of an older build
// refuses the GET"): exit 1, and the line names the node's older build
// (upgrade it, or ask an upgraded node), not only "GET is not allowed".
func TestSettingsOnAnOlderBuildSaysWhatToDo(t *testing.T) {
	old := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		// An older build's answer: PUT /v1/settings only.
		w.Header().Set("Allow", "PUT")
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusMethodNotAllowed)
		fmt.Fprintf(w, `{"error":"%s is not allowed on %s (allowed: PUT)","reason":"method_not_allowed"}`+"\n", r.Method, r.URL.Path)
	}))
	defer old.Close()
	addr := strings.TrimPrefix(old.URL, "http://")
	// An upgraded node after it in --endpoints answers, as after one that
	// cannot be reached: the settings it holds are shown, and set there.
	c := newCluster(t)
	p := indexer.DefaultParams()
	p.Temperature = 0.25
	if err := c.leader().SetSettings(context.Background(), raftfsm.Settings{Params: p, View: indexer.ViewDedup}); err != nil {
		t.Fatal(err)
	}
	r := kvctl(t, "--endpoints", addr+","+c.endpoints(), "settings").wantCode(t, 0)
	if !containsFields(r.stdout, []string{"temperature", "0.25"}) {
		t.Errorf("kvctl settings with a node of an older build first in --endpoints: %s (stderr %q), want the next node's settings", r.stdout, r.stderr)
	}
	kvctl(t, "--endpoints", addr+","+c.endpoints(), "settings", "set", "--temperature", "0.5").wantCode(t, 0)
	if got := c.leader().Settings().Params.Temperature; got != 0.5 {
		t.Errorf("kvctl settings set --temperature 0.5 with a node of an older build first: the leader holds %v", got)
	}
	for _, args := range [][]string{{"settings"}, {"settings", "set", "--temperature", "0.2"}} {
		r := kvctl(t, append([]string{"--endpoints", addr}, args...)...).wantCode(t, 1)
		if !strings.Contains(r.stderr, "build") && !strings.Contains(r.stderr, "upgrade") {
			t.Errorf("kvctl %s against a node of a build before GET /v1/settings: %q, want a line that names its older build (what to do)",
				strings.Join(args, " "), strings.TrimSpace(r.stderr))
		}
	}
}
