package store

import (
	"math"
	"slices"
)

// Records is a run of records, key and value bytes back to back in one
// buffer that is reused from run to run, so that adding a record
// allocates nothing once the buffer has grown: record i's key is
// data[ends[2i-1]:ends[2i]] and its value data[ends[2i]:ends[2i+1]]
// (ends[-1] taken as 0). A snapshot's restore parses its stream into runs
// (raftfsm), and a view copies records out of the database a run at a
// time (StateSnapshot.Each).
//
// A run holds less than 4 GiB (its ends are 32-bit): its users bound
// theirs to a few MiB and one record.
type Records struct {
	data []byte
	ends []uint32
}

// Reset empties the run, keeping its buffers.
func (r *Records) Reset() {
	r.data = r.data[:0]
	r.ends = r.ends[:0]
}

// Grow makes room for n more bytes of keys and values. An empty run's
// buffer is allocated with make rather than slices.Grow, whose append of
// n zero bytes writes them all: for a restore's or a view's batch of a
// few MiB that costs little in a build, but about 6 times make's under
// the race detector, which checks every byte written (a restore of a
// near-empty snapshot took about 0.5 s of it under go test -race).
//
// The ends of an empty run get room for records of 10 bytes on average
// at once (a snapshot's are about 13): grown by append from nothing, they
// took twice their final size in arrays outgrown, which a restore (its
// collector held) faulted in fresh, 10 MiB a batch, 40 MiB in all.
func (r *Records) Grow(n int) {
	if len(r.data) == 0 && cap(r.data) < n {
		r.data = make([]byte, 0, n)
		if cap(r.ends) < n/5 {
			r.ends = make([]uint32, 0, n/5)
		}
		return
	}
	r.data = slices.Grow(r.data, n)
}

// Add appends a record (copies of k and v).
func (r *Records) Add(k, v []byte) {
	r.data = append(r.data, k...)
	r.ends = append(r.ends, uint32(len(r.data)))
	r.data = append(r.data, v...)
	if len(r.data) > math.MaxUint32 {
		panic("store: a run of records over 4 GiB") // its users bound theirs to MiBs
	}
	r.ends = append(r.ends, uint32(len(r.data)))
}

// Len is the number of records; Bytes their keys' and values' bytes.
func (r *Records) Len() int   { return len(r.ends) / 2 }
func (r *Records) Bytes() int { return len(r.data) }

// At returns record i. The slices are the run's until it is reset.
func (r *Records) At(i int) (k, v []byte) {
	ks := uint32(0)
	if i > 0 {
		ks = r.ends[2*i-1]
	}
	ke, ve := r.ends[2*i], r.ends[2*i+1]
	return r.data[ks:ke:ke], r.data[ke:ve:ve]
}

// Each calls fn for every record in order, until fn fails.
func (r *Records) Each(fn func(k, v []byte) error) error {
	prev := uint32(0)
	for i := 0; i < len(r.ends); i += 2 {
		ke, ve := r.ends[i], r.ends[i+1]
		if err := fn(r.data[prev:ke:ke], r.data[ke:ve:ve]); err != nil {
			return err
		}
		prev = ve
	}
	return nil
}
