package main

import (
	"context"
	"math"
	"strconv"
	"strings"

	"github.com/kvrouter/kvrouter/api"
	"github.com/kvrouter/kvrouter/api/client"
	"github.com/kvrouter/kvrouter/indexer"
	"github.com/kvrouter/kvrouter/raftfsm"
	"github.com/urfave/cli/v2"
)

// settingsField is one of kvctl settings set's flags of a weight and
// where its value goes.
type settingsField struct {
	flag *cli.StringFlag
	f    func(*indexer.Params) *float64
}

// settingsFields returns kvctl settings set's flags of the weights, one
// per scoring setting (named as the JSON field, with dashes), in the
// order the table shows; new ones each time, as a flag holds its state.
func settingsFields() []settingsField {
	return []settingsField{
		{&cli.StringFlag{Name: "overlap-score-credit", Usage: "credit per cached token of the prompt (semantics.md §5)"},
			func(p *indexer.Params) *float64 { return &p.OverlapScoreCredit }},
		{&cli.StringFlag{Name: "host-cache-hit-weight", Usage: "weight of a block cached in host memory, against one on the device"},
			func(p *indexer.Params) *float64 { return &p.HostCacheHitWeight }},
		{&cli.StringFlag{Name: "disk-cache-hit-weight", Usage: "weight of a block cached on disk, against one on the device"},
			func(p *indexer.Params) *float64 { return &p.DiskCacheHitWeight }},
		{&cli.StringFlag{Name: "prefill-load-scale", Usage: "weight of the rank's prefill load"},
			func(p *indexer.Params) *float64 { return &p.PrefillLoadScale }},
		{&cli.StringFlag{Name: "decode-active-request-weight", Usage: "weight of the rank's active decode requests"},
			func(p *indexer.Params) *float64 { return &p.DecodeActiveRequestWeight }},
		{&cli.StringFlag{Name: "temperature", Usage: "softmax temperature of the choice; 0 picks the best rank"},
			func(p *indexer.Params) *float64 { return &p.Temperature }},
		{&cli.StringFlag{Name: "busy-decode-fraction", Usage: "a rank is busy past this fraction of its device capacity in decode blocks; 0: no threshold"},
			func(p *indexer.Params) *float64 { return &p.BusyDecodeFraction }},
	}
}

func settingsCommand(e *env) *cli.Command {
	fields := settingsFields()
	flags := make([]cli.Flag, 0, len(fields)+2)
	for _, f := range fields {
		flags = append(flags, f.flag)
	}
	flags = append(flags,
		&cli.StringFlag{Name: "busy-prefill-tokens", Usage: "a rank is busy past this many prefill tokens; 0: no threshold"},
		&cli.StringFlag{Name: "view", Usage: "the index view routes score with: dedup or tiered"})
	return &cli.Command{
		Name:  "settings",
		Usage: "show the cluster's scoring settings, or change them (settings set)",
		Description: "Shows the scoring settings as the answering node's state holds them (the first\n" +
			"endpoint that answers).\n\n" +
			"Example:\n   kvctl settings\n   kvctl settings -o json\n   kvctl settings set --temperature 0.2",
		Action: func(c *cli.Context) error {
			if c.Args().Present() {
				return usagef("unknown command %q (want set, or no argument to show the settings); see %s --help", c.Args().First(), helpName(c))
			}
			return withClient(c, func(ctx context.Context, cl *client.Client) error {
				s, err := cl.Settings(ctx)
				if err != nil {
					return olderBuildHint(err)
				}
				return printSettings(c, e, s)
			})
		},
		Subcommands: []*cli.Command{{
			Name:  "set",
			Usage: "change the scoring settings given by flags, keeping the others",
			Description: "Reads the settings, sets the fields given by flags and puts the result\n" +
				"(PUT /v1/settings replaces every field). Not atomic: a change another client\n" +
				"puts between the read and the write is overwritten. Shows the settings put.\n\n" +
				"Example:\n   kvctl settings set --temperature 0.2 --view tiered\n   kvctl settings set --busy-prefill-tokens 0",
			Flags: flags,
			Action: func(c *cli.Context) error {
				if err := args(c, 0, "no arguments, the settings as flags"); err != nil {
					return err
				}
				set, err := settingsChange(c)
				if err != nil {
					return err
				}
				return withClient(c, func(ctx context.Context, cl *client.Client) error {
					// The leader's settings, caught up: a follower's or a
					// just-elected leader's may lack a change the cluster
					// acknowledged, which the put would undo.
					s, err := cl.ConsistentSettings(ctx)
					if err != nil {
						return olderBuildHint(err)
					}
					set(&s)
					if err := cl.SetSettings(ctx, s.Params, s.View); err != nil {
						return err
					}
					return printSettings(c, e, s)
				})
			},
		}},
	}
}

// settingsChange reads kvctl settings set's flags into the change they
// make; a usage error when none is given or one is not a value.
func settingsChange(c *cli.Context) (func(*raftfsm.Settings), error) {
	var changes []func(*raftfsm.Settings)
	for _, f := range settingsFields() {
		name := f.flag.Name
		if !c.IsSet(name) {
			continue
		}
		v, err := strconv.ParseFloat(strings.TrimSpace(c.String(name)), 64)
		if err != nil || math.IsNaN(v) || math.IsInf(v, 0) || v < 0 {
			return nil, usagef("--%s %q: want a finite number >= 0", name, c.String(name))
		}
		get := f.f
		changes = append(changes, func(s *raftfsm.Settings) { *get(&s.Params) = v })
	}
	if c.IsSet("busy-prefill-tokens") {
		n, err := strconv.ParseInt(strings.TrimSpace(c.String("busy-prefill-tokens")), 10, 64)
		if err != nil || n < 0 {
			return nil, usagef("--busy-prefill-tokens %q: want a whole number >= 0", c.String("busy-prefill-tokens"))
		}
		changes = append(changes, func(s *raftfsm.Settings) { s.Params.BusyPrefillTokens = n })
	}
	if c.IsSet("view") {
		v, ok := indexer.ParseView(c.String("view"))
		if !ok {
			return nil, usagef("--view %q: want dedup or tiered", c.String("view"))
		}
		changes = append(changes, func(s *raftfsm.Settings) { s.View = v })
	}
	if len(changes) == 0 {
		return nil, usagef("%s needs a setting to change (--temperature, --view, ...); see %s --help", helpName(c), helpName(c))
	}
	return func(s *raftfsm.Settings) {
		for _, ch := range changes {
			ch(s)
		}
	}, nil
}

// printSettings shows s: a table of setting and value, or with -o json the
// body of PUT /v1/settings that would put them.
func printSettings(c *cli.Context, e *env, s raftfsm.Settings) error {
	if jsonOut(c) {
		return writeJSON(e.stdout, api.SettingsRequest{Params: &s.Params, View: s.View.String()})
	}
	t := newTable(e.stdout, "SETTING", "VALUE")
	p := s.Params
	for _, f := range settingsFields() {
		t.row(strings.ReplaceAll(f.flag.Name, "-", "_"), strconv.FormatFloat(*f.f(&p), 'g', -1, 64))
	}
	t.row("busy_prefill_tokens", strconv.FormatInt(p.BusyPrefillTokens, 10))
	t.row("view", s.View.String())
	return t.flush()
}

// olderBuildHint wraps an error of GET /v1/settings with what to do when
// the node answered 405: it runs a build before GET /v1/settings, which
// knows PUT only (every endpoint of --endpoints that answered did).
func olderBuildHint(err error) error {
	return withReasonHint(err, api.ReasonMethodNotAllowed,
		"the node runs an earlier build, without GET /v1/settings: upgrade it, or give an upgraded node's endpoint with --endpoints")
}
