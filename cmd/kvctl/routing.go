package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"strconv"
	"strings"

	"github.com/kvrouter/kvrouter/api"
	"github.com/kvrouter/kvrouter/api/client"
	"github.com/kvrouter/kvrouter/indexer"
	"github.com/kvrouter/kvrouter/kvevent"
	"github.com/urfave/cli/v2"
)

func workersCommand(e *env) *cli.Command {
	return &cli.Command{
		Name:  "workers",
		Usage: "list the workers: ranks, blocks per tier, last event id, resync and silence flags, load",
		Description: "One row per rank. --tier keeps one tier's block column in the table (JSON always has\n" +
			"every tier). Read from the leader, or a node that knows it, as members list is.\n\n" +
			"Example:\n   kvctl workers\n   kvctl workers --tier host",
		Flags: []cli.Flag{&cli.StringFlag{Name: "tier", Usage: "show only this `TIER`'s blocks: device, host, disk or external"}},
		Action: func(c *cli.Context) error {
			if err := args(c, 0, "no arguments"); err != nil {
				return err
			}
			tiers := []kvevent.Tier{kvevent.TierDevice, kvevent.TierHostPinned, kvevent.TierDisk, kvevent.TierExternal}
			if name := c.String("tier"); name != "" {
				t, err := kvevent.ParseTier(name)
				if err != nil {
					return usagef("--tier %q: want device, host, disk or external", name)
				}
				tiers = []kvevent.Tier{t}
			}
			return withClient(c, func(ctx context.Context, cl *client.Client) error {
				view, done, err := viewClient(ctx, c, cl)
				if err != nil {
					return err
				}
				defer done()
				ws, err := view.Workers(ctx)
				if err != nil {
					return err
				}
				if jsonOut(c) {
					return writeJSON(e.stdout, ws)
				}
				return printWorkers(e, ws, tiers)
			})
		},
	}
}

func printWorkers(e *env, ws []api.Worker, tiers []kvevent.Tier) error {
	header := []string{"WORKER", "DP", "MODEL", "BLOCK_SIZE"}
	for _, t := range tiers {
		header = append(header, strings.ToUpper(t.String()))
	}
	header = append(header, "LAST_EVENT", "RESYNC", "SILENT", "BUSY", "REQUESTS", "PREFILL_TOKENS", "DECODE_BLOCKS")
	t := newTable(e.stdout, header...)
	for _, w := range ws {
		for _, r := range w.Ranks {
			cells := []string{u64(w.WorkerID), strconv.FormatUint(uint64(r.DPRank), 10), orDash(w.Model), strconv.Itoa(w.BlockSize)}
			for _, tier := range tiers {
				cells = append(cells, i64(r.Blocks.Get(tier)))
			}
			cells = append(cells, u64(r.LastEventID), yesNo(r.NeedsResync), yesNo(r.Silent), yesNo(r.Busy), i64(r.Load.ActiveRequests),
				i64(r.Load.ActivePrefillTokens), i64(r.Load.ActiveDecodeBlocks))
			t.row(cells...)
		}
	}
	if len(ws) == 0 {
		fmt.Fprintln(e.stderr, "kvctl: no workers are registered")
	}
	return t.flush()
}

// overrideKeys are the per-request weights that route --set takes.
var overrideKeys = []string{"overlap_score_credit", "host_cache_hit_weight", "disk_cache_hit_weight",
	"prefill_load_scale", "decode_active_request_weight", "temperature"}

func routeCommand(e *env) *cli.Command {
	return &cli.Command{
		Name:  "route",
		Usage: "ask for a routing decision and show every candidate's cost terms",
		Description: "Give the prompt's token ids (--tokens FILE: a JSON array, or integers separated by\n" +
			"white space or commas; - reads stdin) or its blocks' content hashes (--hashes).\n" +
			"Nothing is booked.\n\n" +
			"Example:\n" +
			"   kvctl route --tokens prompt.json\n" +
			"   kvctl route --hashes 0x9f3a0c1d2e4b5a69,1234567 --isl 40 --set temperature=0.5",
		Flags: []cli.Flag{
			&cli.StringFlag{Name: "tokens", Usage: "read the prompt's token ids from `FILE`"},
			&cli.StringFlag{Name: "hashes", Usage: "the blocks' content `HASHES`, comma-separated (decimal or 0x hex)"},
			&cli.IntFlag{Name: "isl", Usage: "the prompt length in tokens", DefaultText: "from the tokens or hashes"},
			&cli.StringFlag{Name: "lora", Usage: "the LoRA adapter `NAME` (changes the token hashes)"},
			&cli.StringFlag{Name: "salt", Usage: "the cache `SALT` (changes the token hashes)"},
			&cli.StringSliceFlag{Name: "set", Usage: "override a scoring weight for this request, `KEY=VALUE` (" +
				strings.Join(overrideKeys, ", ") + ")"},
		},
		Action: func(c *cli.Context) error {
			if err := args(c, 0, "no arguments (use --tokens FILE or --hashes)"); err != nil {
				return err
			}
			req, err := routeRequest(c, e)
			if err != nil {
				return err
			}
			return withClient(c, func(ctx context.Context, cl *client.Client) error {
				resp, err := cl.Route(ctx, req)
				err = withTooLargeHint(err, "shorten the input, or raise the node's --max-body-bytes")
				var ae *client.Error
				if errors.As(err, &ae) && len(ae.Candidates) > 0 && !jsonOut(c) {
					// Overloaded: show why every rank is busy, then fail.
					fmt.Fprintln(e.stdout, "no rank can take the request:")
					if perr := printCandidates(e, ae.Candidates, ae.CandidatesLeftOut); perr != nil {
						return perr
					}
				}
				if err != nil {
					return err
				}
				if jsonOut(c) {
					return writeJSON(e.stdout, resp)
				}
				fmt.Fprintf(e.stdout, "routed to worker %d dp %d: cost %s, decided by %s (block size %d, %d request blocks)\n\n",
					resp.WorkerID, resp.DPRank, num(resp.Cost), resp.DecidedBy, resp.BlockSize, resp.RequestBlocks)
				return printCandidates(e, resp.Candidates, resp.CandidatesLeftOut)
			})
		},
	}
}

// printCandidates prints the candidates' table, then how many the node
// left out: it lists at most api.MaxCandidates, and an operator looking
// for a rank the table does not show must be told it may be one of those.
func printCandidates(e *env, cands []api.Candidate, leftOut int) error {
	t := newTable(e.stdout, "", "WORKER", "DP", "DEVICE", "HOST", "DISK", "EXTERNAL", "CREDIT", "PREFILL_BLOCKS",
		"DECODE_BLOCKS", "REQUESTS", "PREFILL_TOKENS", "COST", "BUSY", "P")
	for _, c := range cands {
		mark := ""
		if c.Chosen {
			mark = "*"
		}
		busy := "no"
		if c.Busy {
			busy = orDash(c.BusyReason)
		}
		t.row(mark, u64(c.WorkerID), strconv.FormatUint(uint64(c.DPRank), 10),
			i64(c.Overlap.Device), i64(c.Overlap.Host), i64(c.Overlap.Disk), i64(c.Overlap.External),
			num(c.Credit), num(c.PrefillBlocks), i64(c.PotentialDecodeBlocks), i64(c.ActiveRequests),
			i64(c.ActivePrefillTokens), num(c.Cost), busy, num(c.Probability))
	}
	if err := t.flush(); err != nil {
		return err
	}
	if leftOut > 0 {
		fmt.Fprintf(e.stdout, "(%d more candidate ranks left out: a node lists at most %d)\n", leftOut, api.MaxCandidates)
	}
	return nil
}

// routeRequest builds the request from route's flags.
func routeRequest(c *cli.Context, e *env) (api.RouteRequest, error) {
	var req api.RouteRequest
	tokens, hashes := c.String("tokens"), c.String("hashes")
	switch {
	case tokens != "" && hashes != "":
		return req, usagef("give --tokens or --hashes, not both")
	case tokens == "" && hashes == "":
		return req, usagef("route needs --tokens FILE or --hashes h1,h2,...; see kvctl route --help")
	case tokens != "":
		ids, err := readTokens(c.Context, tokens, e.stdin)
		if err != nil {
			return req, err
		}
		req.TokenIDs = ids
	default:
		hs, err := parseHashes(hashes)
		if err != nil {
			return req, err
		}
		req.BlockHashes = hs
	}
	if c.Int("isl") < 0 {
		return req, usagef("--isl %d: want a length in tokens >= 0", c.Int("isl"))
	}
	req.ISL, req.LoRAName, req.CacheSalt = c.Int("isl"), c.String("lora"), c.String("salt")
	if sets := c.StringSlice("set"); len(sets) > 0 {
		o, err := parseOverrides(sets)
		if err != nil {
			return req, err
		}
		req.Overrides = o
	}
	// The node's own check: a value out of the range it takes (a negative
	// temperature, an --isl past raftfsm.MaxISL) is bad input, exit 2,
	// refused here before any request rather than by the node with 400.
	if err := api.CheckRoute(&req); err != nil {
		return req, usagef("route: %v", err)
	}
	return req, nil
}

// maxTokensBytes bounds what kvctl reads of a --tokens input, so that an
// endless one (/dev/zero) ends. It is not the node's bound on a request,
// which a node's --max-body-bytes sets (32 MiB by default) and which
// applies to the request kvctl builds, not to the file: white space,
// commas or a pretty-printed array can make a file several times larger
// than its request. A request over the node's bound is the node's 413.
// A variable for tests.
var maxTokensBytes = 4 * api.DefaultMaxBodyBytes

// readTokens reads token ids from a file ("-": stdin): a JSON array, or
// integers separated by white space or commas. Content that holds no token
// ids is a usage error (exit 2), as a bad --hashes is: the user gave it; a
// file that cannot be read is an error (exit 1), and so is ctx's end
// before the file's (an interrupt).
func readTokens(ctx context.Context, path string, stdin io.Reader) ([]uint32, error) {
	r := stdin
	if path != "-" {
		f, done, err := openLocal(ctx, path)
		if err != nil {
			return nil, fmt.Errorf("--tokens: %w", err)
		}
		defer done()
		r = f
	}
	// No more than maxTokensBytes, and a byte to tell a larger input:
	// reading all of an endless stdin (/dev/zero) would grow kvctl for
	// ever.
	data, err := readAll(ctx, io.LimitReader(r, int64(maxTokensBytes)+1))
	if err != nil {
		return nil, fmt.Errorf("--tokens: %w", err)
	}
	if len(data) > maxTokensBytes {
		return nil, usagef("--tokens %s: larger than %d MiB, more than kvctl reads (a node takes requests of up to its --max-body-bytes, 32 MiB by default)",
			path, maxTokensBytes>>20)
	}
	trimmed := bytes.TrimSpace(data)
	var ids []uint32
	if bytes.HasPrefix(trimmed, []byte("[")) {
		// Into pointers: encoding/json leaves a null element at its zero
		// value, and [1,null,3] would route as the tokens 1 0 3.
		var elems []*uint32
		if err := json.Unmarshal(trimmed, &elems); err != nil {
			return nil, usagef("--tokens %s: not a JSON array of token ids (unsigned 32-bit integers): %v", path, err)
		}
		ids = make([]uint32, len(elems))
		for i, v := range elems {
			if v == nil {
				return nil, usagef("--tokens %s: token %d is null, not a token id (an unsigned 32-bit integer)", path, i)
			}
			ids[i] = *v
		}
	} else {
		for i, f := range strings.FieldsFunc(string(trimmed), func(r rune) bool {
			return r == ',' || r == ' ' || r == '\t' || r == '\n' || r == '\r'
		}) {
			v, err := strconv.ParseUint(f, 10, 32)
			if err != nil {
				return nil, usagef("--tokens %s: token %d %q is not an unsigned 32-bit integer", path, i, f)
			}
			ids = append(ids, uint32(v))
		}
	}
	if len(ids) == 0 {
		return nil, usagef("--tokens %s: no token ids in it", path)
	}
	return ids, nil
}

func parseHashes(s string) ([]uint64, error) {
	var out []uint64
	for i, f := range strings.Split(s, ",") {
		f = strings.TrimSpace(f)
		if f == "" {
			continue
		}
		// Decimal, or hex after 0x: not ParseUint's base 0, which reads
		// a leading zero as octal (010 is 8) and takes 0b, 0o and 1_0.
		var v uint64
		var err error
		if h, ok := strings.CutPrefix(strings.ToLower(f), "0x"); ok {
			v, err = strconv.ParseUint(h, 16, 64)
		} else {
			v, err = strconv.ParseUint(f, 10, 64)
		}
		if err != nil {
			return nil, usagef("--hashes: hash %d %q is not an unsigned 64-bit integer (decimal or 0x hex)", i, f)
		}
		out = append(out, v)
	}
	if len(out) == 0 {
		return nil, usagef("--hashes: no hashes given")
	}
	return out, nil
}

func parseOverrides(sets []string) (*indexer.Overrides, error) {
	o := &indexer.Overrides{}
	fields := map[string]**float64{
		"overlap_score_credit":         &o.OverlapScoreCredit,
		"host_cache_hit_weight":        &o.HostCacheHitWeight,
		"disk_cache_hit_weight":        &o.DiskCacheHitWeight,
		"prefill_load_scale":           &o.PrefillLoadScale,
		"decode_active_request_weight": &o.DecodeActiveRequestWeight,
		"temperature":                  &o.Temperature,
	}
	for _, kv := range sets {
		k, v, ok := strings.Cut(kv, "=")
		dst, known := fields[k]
		if !ok || !known {
			return nil, usagef("--set %q: want KEY=VALUE with KEY one of %s", kv, strings.Join(overrideKeys, ", "))
		}
		f, err := strconv.ParseFloat(v, 64)
		if err != nil || math.IsNaN(f) || math.IsInf(f, 0) {
			return nil, usagef("--set %s: %q is not a finite number", k, v)
		}
		*dst = &f
	}
	return o, nil
}

func indexCommand(e *env) *cli.Command {
	return &cli.Command{
		Name:        "index",
		Usage:       "inspect the KV block index",
		Description: "Example:\n   kvctl index stats",
		Action:      group("stats"),
		Subcommands: []*cli.Command{{
			Name:  "stats",
			Usage: "show the index of the answering node: nodes, blocks per tier, orphans, rejections",
			Description: "The figures are the answering node's (the first endpoint that answers).\n\n" +
				"Example:\n   kvctl index stats\n   kvctl --endpoints n2:7080 index stats -o json",
			Action: func(c *cli.Context) error {
				if err := args(c, 0, "no arguments"); err != nil {
					return err
				}
				return withClient(c, func(ctx context.Context, cl *client.Client) error {
					st, err := cl.IndexStats(ctx)
					if err != nil {
						return err
					}
					if jsonOut(c) {
						return writeJSON(e.stdout, st)
					}
					return printIndexStats(e, st)
				})
			},
		}},
	}
}

func printIndexStats(e *env, st *api.IndexStats) error {
	t := newTable(e.stdout)
	k := st.Counters
	rows := [][2]string{
		{"nodes", i64(st.Nodes)},
		{"ranks", strconv.Itoa(st.Ranks)},
		{"entries", i64(st.Entries)},
		{"blocks device", i64(st.Blocks.Device)},
		{"blocks host", i64(st.Blocks.Host)},
		{"blocks disk", i64(st.Blocks.Disk)},
		{"blocks external", i64(st.Blocks.External)},
		{"orphan events", strconv.Itoa(st.OrphanEvents)},
		{"orphan blocks", strconv.Itoa(st.OrphanBlocks)},
		{"ranks needing resync", strconv.Itoa(st.NeedResync)},
		{"ranks over capacity", strconv.Itoa(st.OverCapacity)},
		{"stored blocks", u64(k.StoredBlocks)},
		{"removed blocks", u64(k.RemovedBlocks)},
		{"clears", u64(k.Cleared)},
		{"unknown removes", u64(k.UnknownRemoves)},
		{"malformed events", u64(k.Malformed)},
		{"orphans held", u64(k.OrphansHeld)},
		{"orphans applied", u64(k.OrphansApplied)},
		{"orphans dropped", u64(k.OrphansDropped)},
		{"remapped hashes", u64(k.Remapped)},
		{"capacity evictions", u64(k.CapacityEvicted)},
		{"name collisions", u64(k.NameCollisions)},
		{"index memory (estimate)", size(st.MemoryBytes)},
		{"heap in use", size(int64(st.HeapBytes))},
	}
	for _, r := range rows {
		t.row(r[0], r[1])
	}
	return t.flush()
}
