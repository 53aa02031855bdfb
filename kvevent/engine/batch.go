package engine

import "github.com/kvrouter/kvrouter/kvevent"

// A Batch receives the router events of decoded payloads. Decode appends to
// it; Reset empties it and keeps its memory, so a caller that resets one
// Batch between payloads decodes without allocating once the slices have
// grown to the size of its largest batch.
//
// The Blocks and Removed slices of the Events point into storage the Batch
// owns: they stay valid until the next Reset, and must be copied by a caller
// that keeps events longer. Each is cut to its own capacity, so appending to
// one never overwrites another.
type Batch struct {
	// Events are the router events, in wire order, with EventID zero: ids are
	// assigned later, by the node agent, after filtering.
	Events []kvevent.Event

	// TS is the engine's timestamp of the last payload decoded (seconds
	// since the epoch, as the engine's clock says; zero when absent).
	TS float64
	// DPRank is the data_parallel_rank of the last payload decoded, valid
	// when HasDPRank. Events carry it in Rank.DP either way.
	DPRank    uint32
	HasDPRank bool

	blocks  []kvevent.Block
	removed []uint64
}

// Reset empties b, keeping its memory for the next Decode.
func (b *Batch) Reset() {
	clear(b.Events) // drop references into the old storage
	b.Events = b.Events[:0]
	b.blocks = b.blocks[:0]
	b.removed = b.removed[:0]
	b.TS, b.DPRank, b.HasDPRank = 0, 0, false
}

// BlockEvents returns the number of block events in b: stored blocks plus
// removed hashes. It is the unit of the decoder's throughput figures.
func (b *Batch) BlockEvents() int {
	n := 0
	for i := range b.Events {
		n += len(b.Events[i].Blocks) + len(b.Events[i].Removed)
	}
	return n
}
