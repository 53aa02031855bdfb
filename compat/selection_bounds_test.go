package compat

import (
	"encoding/json"
	"math"
	"strings"
	"testing"
)

// TestLoadsOfAModelAreItsDefaultGroups: docs/compat.md, GET /loads: a
// model_name without a routing_group gives the ranks of the model's
// default group only, as every other request naming a model without a
// group means that group; with a group, that group's; a group alone,
// the group's over every model.
func TestLoadsOfAModelAreItsDefaultGroups(t *testing.T) {
	n := startNode(t)
	mustCode(t, n.do(t, codecJSON, "POST", "/selection/workers", CatalogWorker{WorkerID: 1, ModelName: "llama",
		Endpoint: "http://h:1", BlockSize: 4}), 201, "add to default")
	mustCode(t, n.do(t, codecJSON, "POST", "/selection/workers", CatalogWorker{WorkerID: 2, ModelName: "llama",
		RoutingGroup: "red", Endpoint: "http://h:2", BlockSize: 4}), 201, "add to red")
	for _, c := range []struct {
		query string
		want  []uint64
	}{
		{"model_name=llama", []uint64{1}},
		{"model_name=llama&routing_group=red", []uint64{2}},
		{"routing_group=red", []uint64{2}},
		{"", []uint64{1, 2}},
	} {
		r := n.do(t, codecJSON, "GET", "/selection/loads?"+c.query, nil)
		mustCode(t, r, 200, "loads?"+c.query)
		var ls []RankLoad
		if err := json.Unmarshal(r.body, &ls); err != nil {
			t.Fatal(err)
		}
		var got []uint64
		for _, l := range ls {
			got = append(got, l.WorkerID)
		}
		if len(got) != len(c.want) || len(got) > 0 && (got[0] != c.want[0] || got[len(got)-1] != c.want[len(c.want)-1]) {
			t.Errorf("GET /selection/loads?%s: workers %v, want %v", c.query, got, c.want)
		}
	}
}

// TestDecayFractionNaNIsRefused: docs/compat.md, output_block's
// decay_fraction is a number in [0, 1]. JSON cannot carry a NaN, but
// MessagePack can: it is a 400 that names the field, and books nothing
// (a NaN fraction's weight is no number).
func TestDecayFractionNaNIsRefused(t *testing.T) {
	n := startNode(t)
	mustCode(t, n.do(t, codecJSON, "POST", "/selection/workers", CatalogWorker{WorkerID: 1, ModelName: "llama",
		Endpoint: "http://h:1", BlockSize: 4}), 201, "add")
	mustCode(t, n.do(t, codecJSON, "POST", "/selection/reservations", ReservationRequest{ReservationID: "r1", ModelName: "llama",
		WorkerID: 1, SequenceHashes: []Hash{1, 2, 3, 4}, ISLTokens: 16}), 201, "reserve")
	for _, f := range []float64{math.NaN(), math.Inf(1), math.Inf(-1)} {
		r := n.do(t, codecMsgpack, "POST", "/selection/reservations/r1/output_block", map[string]any{"decay_fraction": f})
		if r.code != 400 || !strings.Contains(string(r.body), "decay_fraction") {
			t.Errorf("output_block with decay_fraction %v in MessagePack: %d %q, want a 400 naming decay_fraction", f, r.code, r.body)
		}
	}
	if l := loadOf(t, n, "llama", 1, 0); l.ActiveDecodeBlocks != 4 {
		t.Errorf("active decode blocks %d after refused output blocks, want the reservation's 4", l.ActiveDecodeBlocks)
	}
}

// TestPotentialLoadsOfNegativeISLTokensIsA400: docs/compat.md,
// POST /potential_loads: isl_tokens is a count of tokens, and a negative
// one is a 400 naming it, as /select's is, not loads computed from it.
func TestPotentialLoadsOfNegativeISLTokensIsA400(t *testing.T) {
	n := startNode(t)
	mustCode(t, n.do(t, codecJSON, "POST", "/selection/workers", CatalogWorker{WorkerID: 1, ModelName: "llama",
		Endpoint: "http://h:1", BlockSize: 4}), 201, "add")
	for _, c := range []codec{codecJSON, codecMsgpack} {
		r := n.do(t, c, "POST", "/selection/potential_loads", PotentialLoadsRequest{ModelName: "llama",
			SequenceHashes: []Hash{1, 2}, ISLTokens: -8})
		if r.code != 400 || !strings.Contains(string(r.body), "isl_tokens") {
			t.Errorf("potential_loads with isl_tokens -8 (%v): %d %q, want a 400 naming isl_tokens", c, r.code, r.body)
		}
	}
}
