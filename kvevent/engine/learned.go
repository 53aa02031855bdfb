package engine

// learnedHashes remembers, for blocks stored earlier with their tokens, the
// content hash of each engine hash and the engine hash of its parent, so that
// a later store that carries no tokens (an offload-tier store: the connector
// knows only block hashes) can still place its blocks in the tree. The
// parent serves a store that names none: vLLM's offloading connector
// announces each offloaded block alone, without its parent (docs/events.md),
// and the block belongs under the parent its device store named, not at the
// root.
//
// Why entries are never removed on a BlockRemoved, of the device tier or any
// other: an engine hash is a hash of the block's content and of its prefix
// (tokens, parent, LoRA, extra keys), so within one engine process the local
// hash and the parent it maps to never change. An entry can go stale but never wrong.
// Forgetting on a device remove would break exactly the case this map is for:
// offload connectors commonly store a block in host memory or on disk when,
// or after, the device evicts it. A Cleared event does not empty it either,
// for the same reason. What bounds it is its size; Decoder.Reset (a new epoch
// of the rank: the engine restarted, and its hashes may be seeded anew)
// empties it.
//
// The bound is kept by two generations, in the way of a CLOCK cache without
// per-entry bookkeeping: new entries go into cur; when cur is full, old is
// dropped and cur becomes old. A block resolved from old is moved back to cur
// (keep), so a block that keeps being offloaded stays. A store's chain is
// looked up whole before any of it is kept: keeping one block may rotate the
// generations and clear old, which may hold the rest of the chain. At most 2×half entries
// are held, and in steady state the two maps are recycled (clear keeps their
// buckets), so learning allocates nothing.
type learnedHashes struct {
	cur, old map[uint64]learned
	half     int // entries per generation; 0 disables learning
}

// learned is what a store with tokens taught of one engine hash.
type learned struct {
	local     uint64 // the block's content hash
	parent    uint64 // its parent's engine hash, when hasParent
	hasParent bool   // false: the block starts a sequence (the root's child)
}

func newLearned(max int) learnedHashes {
	if max <= 0 {
		return learnedHashes{}
	}
	half := (max + 1) / 2
	return learnedHashes{half: half, cur: make(map[uint64]learned), old: make(map[uint64]learned)}
}

func (l *learnedHashes) put(engine uint64, v learned) {
	if l.half == 0 {
		return
	}
	if len(l.cur) >= l.half {
		if _, ok := l.cur[engine]; !ok {
			clear(l.old)
			l.old, l.cur = l.cur, l.old
		}
	}
	l.cur[engine] = v
}

// get looks engine up, and changes nothing.
func (l *learnedHashes) get(engine uint64) (learned, bool) {
	if l.half == 0 {
		return learned{}, false
	}
	if v, ok := l.cur[engine]; ok {
		return v, true
	}
	v, ok := l.old[engine]
	return v, ok
}

// keep moves a pair that get found into cur, unless it is there already.
func (l *learnedHashes) keep(engine uint64, v learned) {
	if l.half == 0 {
		return
	}
	if _, ok := l.cur[engine]; ok {
		return
	}
	delete(l.old, engine)
	l.put(engine, v)
}

func (l *learnedHashes) len() int { return len(l.cur) + len(l.old) }

func (l *learnedHashes) reset() {
	clear(l.cur)
	clear(l.old)
}
