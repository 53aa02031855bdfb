package manager

import (
	"fmt"
	"math"
)

// FilterConfig says which blocks are worth writing to G3 (disk).
//
// A block is written to G3 once it has been seen Threshold times, where a
// sighting is an Offload request for it that carries a priority or an
// Onboard that found it in G2 or G3, and counts decay: every HalfLife
// sightings (of any block) each count is halved. A block offloaded once and
// never asked for again therefore never reaches the disk, which is what
// spares the SSD: most KV blocks are never reused.
type FilterConfig struct {
	// Always writes every block to G3 (from G2 as soon as it is stored
	// there; without G2, from G1 on its first Offload), ignoring counts.
	Always bool
	// Threshold is the number of sightings a block needs; default 2, at
	// most math.MaxUint32 (the counts' range). A Threshold of 1 is the same
	// as Always.
	Threshold int
	// HalfLife is the number of sightings after which every count is halved
	// (rounding down; a count that reaches zero is forgotten); default 65536.
	// The filter then tracks at most 2 × HalfLife hashes (about 100 bytes
	// each).
	HalfLife int
}

const (
	defaultThreshold = 2
	defaultHalfLife  = 1 << 16
)

// Check reports a configuration New would refuse (ErrInvalid): a negative
// threshold or half-life, or a threshold past the counts' range. It lets a
// caller that starts Managers later refuse bad settings up front.
func (c FilterConfig) Check() error { return c.check() }

func (c *FilterConfig) check() error {
	if c.Threshold < 0 || c.HalfLife < 0 {
		return fmt.Errorf("%w: filter threshold %d, half-life %d", ErrInvalid, c.Threshold, c.HalfLife)
	}
	if uint64(c.Threshold) > math.MaxUint32 {
		// A count is a uint32: a larger threshold would wrap (1<<32 to 0,
		// every block hot on its first sighting).
		return fmt.Errorf("%w: filter threshold %d above %d", ErrInvalid, c.Threshold, uint32(math.MaxUint32))
	}
	if c.Threshold == 0 {
		c.Threshold = defaultThreshold
	}
	if c.HalfLife == 0 {
		c.HalfLife = defaultHalfLife
	}
	if c.Threshold == 1 {
		c.Always = true
	}
	return nil
}

// Sightings is the frequency filter: a decaying count per hash and, with
// each, a value M of the caller's (the Manager keeps the block's metadata
// from its last Offload there, which a promotion from G2 to G3 needs and
// the pools do not hand out; the simulator keeps nothing).
//
// Decay is by halving, as TinyLFU's reset does: after every HalfLife
// sightings all counts are halved. That bounds the memory without a clock:
// if M is the sum of the counts just after a halving, the next halving
// happens at most M + HalfLife and leaves at most half of that, so M never
// exceeds HalfLife, and since every tracked hash has a count of at least
// one, at most 2 × HalfLife hashes are ever tracked. The halving sweeps the
// map once, so it costs O(1) per sighting amortized.
//
// It is not safe for concurrent use; the Manager guards its own.
type Sightings[M any] struct {
	cfg   FilterConfig
	since int // sightings since the last halving
	m     map[uint64]sighting[M]
}

type sighting[M any] struct {
	n     uint32
	known bool // meta was given by a See
	meta  M
}

// NewSightings returns an empty filter; cfg's zero fields take their
// defaults. It fails as FilterConfig.Check does.
func NewSightings[M any](cfg FilterConfig) (*Sightings[M], error) {
	if err := cfg.check(); err != nil {
		return nil, err
	}
	return &Sightings[M]{cfg: cfg, m: make(map[uint64]sighting[M])}, nil
}

// See counts one sighting of h and returns its count, this one included.
// meta, when not nil, is remembered with h (until h is forgotten).
func (s *Sightings[M]) See(h uint64, meta *M) uint32 {
	e := s.m[h]
	e.n++
	if meta != nil {
		e.meta, e.known = *meta, true
	}
	s.m[h] = e
	s.since++
	if s.since >= s.cfg.HalfLife {
		s.halve()
	}
	return e.n
}

// Hot reports whether a block seen n times is to be written to G3.
func (s *Sightings[M]) Hot(n uint32) bool { return s.cfg.Always || n >= uint32(s.cfg.Threshold) }

// Count returns h's current count.
func (s *Sightings[M]) Count(h uint64) uint32 { return s.m[h].n }

// Meta returns what the last See of h with a value remembered.
func (s *Sightings[M]) Meta(h uint64) (M, bool) {
	e, ok := s.m[h]
	return e.meta, ok && e.known
}

func (s *Sightings[M]) halve() {
	s.since = 0
	for h, e := range s.m {
		if e.n >>= 1; e.n == 0 {
			delete(s.m, h)
		} else {
			s.m[h] = e
		}
	}
}

// Len returns how many hashes the filter tracks.
func (s *Sightings[M]) Len() int { return len(s.m) }
