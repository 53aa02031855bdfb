package manager

import (
	"fmt"

	"github.com/kvrouter/kvrouter/offload/pool"
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
	// Threshold is the number of sightings a block needs; default 2. A
	// Threshold of 1 is the same as Always.
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

func (c *FilterConfig) check() error {
	if c.Threshold < 0 || c.HalfLife < 0 {
		return fmt.Errorf("%w: filter threshold %d, half-life %d", ErrInvalid, c.Threshold, c.HalfLife)
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

// sightings is the frequency filter: a decaying count per hash, and the
// block's metadata (parent, content hash, priority) from its last Offload,
// which a promotion from G2 to G3 needs and the pools do not hand out.
//
// Decay is by halving, as TinyLFU's reset does: after every HalfLife
// sightings all counts are halved. That bounds the memory without a clock:
// if M is the sum of the counts just after a halving, the next halving
// happens at most M + HalfLife and leaves at most half of that, so M never
// exceeds HalfLife, and since every tracked hash has a count of at least
// one, at most 2 × HalfLife hashes are ever tracked. The halving sweeps the
// map once, so it costs O(1) per sighting amortized.
//
// It is not safe for concurrent use; the Manager guards it.
type sightings struct {
	cfg   FilterConfig
	since int // sightings since the last halving
	m     map[uint64]sighting
}

type sighting struct {
	n     uint32
	prio  int
	known bool // block and prio were set by an Offload
	block pool.Block
}

func newSightings(cfg FilterConfig) *sightings {
	return &sightings{cfg: cfg, m: make(map[uint64]sighting)}
}

// see counts one sighting of h and returns its count, this one included.
// b, when not nil, is remembered with prio for a later promotion.
func (s *sightings) see(h uint64, b *pool.Block, prio int) uint32 {
	e := s.m[h]
	e.n++
	if b != nil {
		e.block, e.prio, e.known = *b, prio, true
	}
	s.m[h] = e
	s.since++
	if s.since >= s.cfg.HalfLife {
		s.halve()
	}
	return e.n
}

// hot reports whether a block seen n times is to be written to G3.
func (s *sightings) hot(n uint32) bool { return s.cfg.Always || n >= uint32(s.cfg.Threshold) }

// count returns h's current count.
func (s *sightings) count(h uint64) uint32 { return s.m[h].n }

// block returns what the last Offload of h said about it.
func (s *sightings) block(h uint64) (pool.Block, int, bool) {
	e, ok := s.m[h]
	return e.block, e.prio, ok && e.known
}

func (s *sightings) halve() {
	s.since = 0
	for h, e := range s.m {
		if e.n >>= 1; e.n == 0 {
			delete(s.m, h)
		} else {
			s.m[h] = e
		}
	}
}

func (s *sightings) len() int { return len(s.m) }
