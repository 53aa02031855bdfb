package engine

import (
	"unsafe"

	"github.com/kvrouter/kvrouter/kvevent"
)

// A Batch receives the router events of decoded payloads. Decode appends to
// it; Reset empties it and keeps its memory, so a caller that resets one
// Batch between payloads decodes without allocating once the slices have
// grown to the size of its largest batch, up to maxKeptBytes a slice: the
// storage of a larger one is dropped by Reset.
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
	// when HasDPRank. Events carry Config.Rank: a payload whose rank is not
	// Config.Rank.DP emits none (ReasonOtherDPRank).
	DPRank    uint32
	HasDPRank bool

	blocks  []kvevent.Block
	removed []uint64
}

// Reset empties b, keeping its memory for the next Decode unless a slice
// has grown past maxKeptBytes.
func (b *Batch) Reset() {
	clear(b.Events) // drop references into the old storage
	b.Events = reuse(b.Events)
	b.blocks = reuse(b.blocks)
	b.removed = reuse(b.removed)
	b.TS, b.DPRank, b.HasDPRank = 0, 0, false
}

// maxKeptBytes bounds the storage each slice reused from payload to payload
// (a Batch's, the decoder's) keeps once emptied: 64Ki blocks, 128Ki hashes,
// 256Ki tokens. A slice grows to the largest event it has held, and one
// eviction step can remove millions of blocks in one event: kept, that
// storage (tens of MB a rank) would be held for the rest of the run. A
// larger batch allocates its storage anew each time instead, at a cost
// small beside decoding that many blocks.
const maxKeptBytes = 1 << 20

// reuse returns s emptied, keeping its storage unless that is larger than
// maxKeptBytes.
func reuse[T any](s []T) []T {
	var zero T
	if uintptr(cap(s))*unsafe.Sizeof(zero) > maxKeptBytes {
		return nil
	}
	return s[:0]
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
