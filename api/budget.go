package api

import (
	"fmt"
	"net/http"

	"github.com/kvrouter/kvrouter/internal/jsonscan"
	"github.com/kvrouter/kvrouter/raftfsm"
)

// A JSON body decodes into Go values far larger than its bytes: "{}," is
// an event of the API (96 bytes) and of the node (104), and the slice
// holding it grows by copying, so a body of 1 MiB of them allocated 234
// MB before its first event was refused, and one at the body limit
// (32 MiB) about 7 GB. A body whose arrays hold structs is therefore
// sized before it is decoded (checkDecodeBudget): jsonscan.Elements
// counts its array elements at each depth, which weigh what decoding
// them and converting them for the node allocates, and a body that
// would take more than decodeBudget is refused 413 too_large, having
// allocated nothing. A request of real events is far below it (an event
// is tens of bytes on the wire, and its blocks' hashes twenty digits).

// decodeBudgetFactor and decodeBudgetFloor make a body's budget: what
// decoding it may allocate, the larger of this many times its size and
// this many bytes, so that small bodies are never refused for it.
const (
	decodeBudgetFactor = 8
	decodeBudgetFloor  = 16 << 20
)

// decodeCosts are the bytes that decoding one array element of a body
// and converting it allocate, by the element's depth (jsonscan.Elements),
// growth of the slices holding them included, as measured by
// TestJSONBodiesAllocateWithinTheirBudget, which fails when one falls short. An
// element is charged its array's struct whatever it is: encoding/json
// makes room for a value of the wrong type too, and carries on.
type decodeCosts [jsonscan.CountDepth]int

var (
	// POST /v1/events: batches, their events, and the events' blocks or
	// removed hashes (a block's cost, the larger).
	eventsCosts = decodeCosts{2: 264, 4: 672, 6: 136}
	// A rank dump: its events, and their blocks.
	dumpCosts = decodeCosts{2: 672, 4: 136}
	// A registration: its dp_ranks (at most limits.MaxDPRanks valid).
	registerCosts = decodeCosts{2: 28}
	// A route whose array decodeRouteBody could not size first: its
	// token ids or block hashes (the larger), grown by encoding/json.
	routeGrownCosts = decodeCosts{2: 40}
)

// DecodeBudgetFloor is the decode budget of the smallest JSON body: a
// POST /v1/events whose EventsDecodeCost is no more is never refused for
// its budget, whatever its size.
const DecodeBudgetFloor = decodeBudgetFloor

// EventsDecodeCost is what a node charges a POST /v1/events of batches
// (EventsRequestFrom) against its decode budget: a request costing more
// than DecodeBudgetFloor is refused 413 too_large when it also costs more
// than 8 times its body's size, and a client sends its batches in several
// requests instead (client.IngestEvents does).
func EventsDecodeCost(batches []raftfsm.RankBatch) int64 {
	var cost int64
	for i := range batches {
		cost += int64(eventsCosts[2])
		for j := range batches[i].Events {
			e := &batches[i].Events[j]
			// A stored event's blocks, a removed one's hashes, at depth 6.
			cost += int64(eventsCosts[4]) + int64(eventsCosts[6])*int64(len(e.Blocks)+len(e.Removed))
		}
	}
	return cost
}

// maxCost is the most one element of costs weighs.
func (c *decodeCosts) maxCost() int {
	return max(c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7])
}

// decodeBudget is what decoding a body of n bytes may allocate.
func decodeBudget(n int) int64 {
	return max(decodeBudgetFactor*int64(n), decodeBudgetFloor)
}

// checkDecodeBudget refuses b (413 too_large) when decoding it, with the
// costs of its endpoint, would allocate more than its budget. A body too
// short to reach the budget whatever it holds (every element takes two
// bytes at least, "0,") is not scanned.
func checkDecodeBudget(b []byte, costs *decodeCosts) error {
	budget := decodeBudget(len(b))
	if int64(len(b)/2+1)*int64(costs.maxCost()) <= budget {
		return nil
	}
	n := jsonscan.Elements(b)
	var total, elems int64
	for d, c := range costs {
		total += int64(n[d]) * int64(c)
		if c > 0 {
			elems += int64(n[d])
		}
	}
	if total <= budget {
		return nil
	}
	return &httpError{code: http.StatusRequestEntityTooLarge, reason: ReasonTooLarge,
		err: fmt.Errorf("the body's %d array elements would take about %d MiB to decode, over the node's budget of %d MiB for a body of %d bytes (%d times its size, at least %d MiB): send them in smaller requests",
			elems, total>>20, budget>>20, len(b), decodeBudgetFactor, decodeBudgetFloor>>20)}
}
