package api

import (
	"encoding/json"
	"testing"

	"github.com/kvrouter/kvrouter/indexer"
	"github.com/kvrouter/kvrouter/kvevent"
	"github.com/kvrouter/kvrouter/raftfsm"
)

// TestARouteAnswerListsAtMostMaxCandidates: a route's answer listed every
// rank's score, and a cluster of 819,200 ranks answered one route with
// 219 MB. It lists the chosen rank and the best others, MaxCandidates in
// all, in rank order, and says how many it left out.
func TestARouteAnswerListsAtMostMaxCandidates(t *testing.T) {
	const n = MaxCandidates + 44
	// Rank i costs n-i, and ranks 0 to 9 are busy: rank 10, chosen (as a
	// sample may choose), has the worst cost of the idle ones.
	d := indexer.Decision{Index: 10}
	for i := range n {
		d.Candidates = append(d.Candidates, indexer.CandidateScore{Rank: kvevent.Rank{Worker: 1, DP: uint32(i)},
			Cost: float64(n - i), Busy: i < 10})
	}
	d.Rank = d.Candidates[d.Index].Rank
	out := routeResponse(&raftfsm.RouteResult{Decision: d}, false)
	if len(out.Candidates) != MaxCandidates || out.CandidatesLeftOut != n-MaxCandidates {
		t.Fatalf("%d candidates listed, %d left out; want %d and %d", len(out.Candidates), out.CandidatesLeftOut, MaxCandidates, n-MaxCandidates)
	}
	if first := out.Candidates[0]; !first.Chosen || first.DPRank != 10 {
		t.Fatalf("the first listed is rank %d (chosen %v), want the chosen rank 10", first.DPRank, first.Chosen)
	}
	for i, c := range out.Candidates {
		if c.Busy {
			t.Fatalf("busy rank %d listed before idle ones with a worse cost", c.DPRank)
		}
		if i > 0 && c.DPRank <= out.Candidates[i-1].DPRank {
			t.Fatalf("candidates out of rank order at %d", i)
		}
	}
	// Left out: the 10 busy ranks, and the 34 worst costs but the chosen
	// one's, ranks 11 to 44.
	if got := out.Candidates[1].DPRank; got != 45 {
		t.Fatalf("second listed rank %d, want 45", got)
	}
	body, _ := json.Marshal(out)
	var back map[string]any
	if err := json.Unmarshal(body, &back); err != nil || back["candidates_left_out"] != float64(n-MaxCandidates) {
		t.Fatalf("candidates_left_out = %v (%v), want %d", back["candidates_left_out"], err, n-MaxCandidates)
	}
	// Within the bound, every candidate and no count.
	d.Candidates, d.Index = d.Candidates[:3], 0
	if out := routeResponse(&raftfsm.RouteResult{Decision: d}, false); len(out.Candidates) != 3 || out.CandidatesLeftOut != 0 {
		t.Fatalf("3 candidates: %d listed, %d left out", len(out.Candidates), out.CandidatesLeftOut)
	}
}
