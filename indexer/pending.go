// pending.go is the load of bookings decided and proposed but not yet
// applied: what lets a node "apply its own bookings optimistically and
// reconcile when the entry commits" (semantics.md §6). A leader deciding
// booked routes from the committed load alone would send every route that
// arrives before the first booking commits to the same rank, and admit them
// all past the busy thresholds.
//
// A pending booking adds to its rank what Sequences.Add would add if it
// applied now: one request, max(isl-cached, 0) prefill tokens, and the
// decode blocks of its distinct sequence hashes that the rank holds
// neither in live bookings nor through another pending booking. Those
// hashes are recorded, so that a later request sharing them sees them held
// (its potential decode blocks do not count them again).
//
// A booking records every distinct hash of its own that the rank's live
// bookings did not hold when it was added, and each (hash, rank) counts
// the pending bookings that hold it: the first one adds the block, and
// it goes only with the last, so that dropping a booking (never to
// apply) leaves the blocks that another pending booking of its rank
// still brings.
//
// Invariants:
//   - byID holds each request id at most once; a rank has an entry in ranks
//     exactly while it has a pending booking, and its load is the sum of
//     its pending bookings' requests and prefill tokens, with
//     Load.ActiveDecodeBlocks the number of hashes held on it.
//   - holders[h] lists, once each, the ranks that hold h through a pending
//     booking, each with the number (> 0) of its pending bookings whose
//     blocks have h.
//   - It reads no clock and is not safe for concurrent use: its owner
//     orders the calls (the decision and the apply of a booking).
//   - Empty, it keeps little of a burst's memory (a leader's list is empty
//     most of the time): at most pendingSpare spare bookings, and its maps
//     made anew once they held more than pendingKeep entries.

package indexer

import (
	"slices"

	"github.com/kvrouter/kvrouter/kvevent"
)

// What an empty Pending keeps of a burst (Go maps never shrink).
const (
	pendingSpare       = 16      // spare bookings, for the next Adds
	pendingSpareBlocks = 1 << 12 // hashes a spare booking, or Add's scratch, has room for
	pendingKeep        = 1 << 12 // entries the maps held, past which they are made anew
)

// Pending holds bookings that are decided but not yet applied to the
// Sequences they will go to. The zero value is not ready; use NewPending.
type Pending struct {
	byID    map[string]*pendingBooking
	ranks   map[kvevent.Rank]*pendingRank
	holders map[uint64]pendingHolders
	peak    int // the most entries byID or holders held since made
	set     hashSet
	ticket  uint64
	spare   []*pendingBooking // removed bookings, for the next Add
	news    []uint64          // Add's scratch
}

type pendingRank struct {
	rank kvevent.Rank
	load Load
	hits int64 // AddTo's scratch
}

type pendingBooking struct {
	id      string
	ticket  uint64
	rank    *pendingRank
	prefill int64
	blocks  []uint64 // its distinct hashes its rank's live bookings did not hold
}

// pendingHolders lists the ranks that hold one hash through a pending
// booking; most hashes have one, which lives inline.
type pendingHolders struct {
	first pendingHold
	rest  []pendingHold
}

// pendingHold is a rank holding a hash, and how many of its pending
// bookings do.
type pendingHold struct {
	rank *pendingRank
	n    int
}

// NewPending returns an empty Pending.
func NewPending() *Pending {
	return &Pending{
		byID:    make(map[string]*pendingBooking),
		ranks:   make(map[kvevent.Rank]*pendingRank),
		holders: make(map[uint64]pendingHolders),
	}
}

// Len returns the number of pending bookings.
func (p *Pending) Len() int { return len(p.byID) }

// RankOf returns the rank request id is pending on; false when it is not.
func (p *Pending) RankOf(id string) (kvevent.Rank, bool) {
	if b, ok := p.byID[id]; ok {
		return b.rank.rank, true
	}
	return kvevent.Rank{}, false
}

// Add records the booking of request id on rank, which s has not applied
// yet, and returns a ticket for Drop. It records nothing and returns 0
// when id is pending already or known to s (live, or freed and not swept):
// its apply will add nothing, so it must not count twice. isl and
// cachedTokens are as for Sequences.Add.
func (p *Pending) Add(s *Sequences, id string, rank kvevent.Rank, seqHashes []uint64, isl, cachedTokens int) uint64 {
	if _, ok := p.byID[id]; ok {
		return 0
	}
	news, known := s.unheld(p.news[:0], id, rank, seqHashes, &p.set)
	p.news = news[:0]
	if known {
		return 0
	}
	pr := p.ranks[rank]
	if pr == nil {
		pr = &pendingRank{rank: rank}
		p.ranks[rank] = pr
	}
	var b *pendingBooking
	if n := len(p.spare); n > 0 {
		b, p.spare = p.spare[n-1], p.spare[:n-1]
	} else {
		b = new(pendingBooking)
	}
	p.ticket++
	*b = pendingBooking{id: id, ticket: p.ticket, rank: pr, prefill: max(int64(isl)-int64(cachedTokens), 0), blocks: b.blocks[:0]}
	for _, h := range news {
		b.blocks = append(b.blocks, h)
		hs, ok := p.holders[h]
		switch {
		case !ok:
			p.holders[h] = pendingHolders{first: pendingHold{rank: pr, n: 1}}
		case hs.first.rank == pr:
			hs.first.n++ // another pending booking added it to this rank
			p.holders[h] = hs
			continue
		default:
			if i := slices.IndexFunc(hs.rest, func(hd pendingHold) bool { return hd.rank == pr }); i >= 0 {
				hs.rest[i].n++
				continue
			}
			hs.rest = append(hs.rest, pendingHold{rank: pr, n: 1})
			p.holders[h] = hs
		}
		pr.load.ActiveDecodeBlocks++
	}
	pr.load.ActivePrefillTokens += b.prefill
	pr.load.ActiveRequests++
	p.byID[id] = b
	p.peak = max(p.peak, len(p.byID), len(p.holders))
	return b.ticket
}

// Settle removes id's pending booking, whichever Add recorded it: its
// entry applied (Sequences now counts it, or refused it).
func (p *Pending) Settle(id string) {
	if b, ok := p.byID[id]; ok {
		p.remove(b)
	}
}

// Drop removes id's pending booking if it is the one Add returned ticket
// for: the caller that added it gave up on it, and must not remove a
// later Add's.
func (p *Pending) Drop(id string, ticket uint64) {
	if b, ok := p.byID[id]; ok && b.ticket == ticket {
		p.remove(b)
	}
}

// Clear removes every pending booking, and lets go of what they grew.
func (p *Pending) Clear() {
	for _, b := range p.byID {
		p.remove(b)
	}
	p.shrink()
}

func (p *Pending) remove(b *pendingBooking) {
	pr := b.rank
	for _, h := range b.blocks {
		hs := p.holders[h]
		switch {
		case hs.first.rank == pr && hs.first.n > 1:
			hs.first.n-- // another pending booking of the rank holds it
		case hs.first.rank == pr && len(hs.rest) == 0:
			delete(p.holders, h)
			pr.load.ActiveDecodeBlocks--
			continue
		case hs.first.rank == pr:
			hs.first = hs.rest[len(hs.rest)-1]
			hs.rest = hs.rest[:len(hs.rest)-1]
			pr.load.ActiveDecodeBlocks--
		default:
			i := slices.IndexFunc(hs.rest, func(hd pendingHold) bool { return hd.rank == pr })
			if i < 0 {
				continue
			}
			if hs.rest[i].n--; hs.rest[i].n > 0 {
				continue
			}
			hs.rest[i] = hs.rest[len(hs.rest)-1]
			hs.rest = hs.rest[:len(hs.rest)-1]
			pr.load.ActiveDecodeBlocks--
		}
		p.holders[h] = hs
	}
	pr.load.ActivePrefillTokens -= b.prefill
	pr.load.ActiveRequests--
	if pr.load.ActiveRequests == 0 {
		delete(p.ranks, pr.rank)
	}
	delete(p.byID, b.id)
	if len(p.spare) < pendingSpare && cap(b.blocks) <= pendingSpareBlocks {
		*b = pendingBooking{blocks: b.blocks[:0]}
		p.spare = append(p.spare, b)
	}
	if len(p.byID) == 0 {
		p.shrink()
	}
}

// shrink lets go, once nothing is pending, of what a burst grew: maps
// that held more than pendingKeep entries, and large scratch.
func (p *Pending) shrink() {
	if p.peak > pendingKeep {
		p.byID = make(map[string]*pendingBooking)
		p.ranks = make(map[kvevent.Rank]*pendingRank)
		p.holders = make(map[uint64]pendingHolders)
		p.peak = 0
	}
	if cap(p.news) > pendingSpareBlocks {
		p.news = nil
	}
	if len(p.set.keys) > 2*pendingSpareBlocks {
		p.set = hashSet{}
	}
}

// AddTo adds the pending load to the candidates, which are in rank order
// and hold the committed load (Sequences.PotentialDecodeBlocks) for a
// request with the given sequence hashes: each candidate's Load grows by
// its rank's pending bookings', and its PotentialDecodeBlocks by the
// blocks they add less those of the request among them. A rank that is
// not a candidate is left out. With nothing pending it does nothing.
func (p *Pending) AddTo(cands []Candidate, seqHashes []uint64) {
	if len(p.byID) == 0 {
		return
	}
	p.set.reset(len(seqHashes))
	for _, h := range seqHashes {
		if !p.set.insert(h) {
			continue
		}
		hs, ok := p.holders[h]
		if !ok {
			continue
		}
		hs.first.rank.hits++
		for _, hd := range hs.rest {
			hd.rank.hits++
		}
	}
	for r, pr := range p.ranks {
		hits := pr.hits
		pr.hits = 0
		i, ok := slices.BinarySearchFunc(cands, r, func(c Candidate, r kvevent.Rank) int { return c.Rank.Compare(r) })
		if !ok {
			continue
		}
		c := &cands[i]
		c.Load.ActivePrefillTokens += pr.load.ActivePrefillTokens
		c.Load.ActiveDecodeBlocks += pr.load.ActiveDecodeBlocks
		c.Load.ActiveRequests += pr.load.ActiveRequests
		c.PotentialDecodeBlocks += pr.load.ActiveDecodeBlocks - hits
	}
}

// unheld appends to dst the distinct hashes of seqHashes that rank's live
// bookings do not hold, and returns it; known is true, and dst left as it
// was, when id is live or a tombstone (an Add of it would book nothing).
func (s *Sequences) unheld(dst []uint64, id string, rank kvevent.Rank, seqHashes []uint64, set *hashSet) (_ []uint64, known bool) {
	s.mu.RLock()
	defer s.mu.RUnlock()
	st := &s.st
	if _, ok := st.byID[id]; ok {
		return dst, true
	}
	var refs map[uint64]refEntry
	if sl, ok := st.slotOf[rank]; ok {
		refs = st.slots[sl].refs
	}
	set.reset(len(seqHashes))
	for _, h := range seqHashes {
		if set.insert(h) && refs[h].n == 0 {
			dst = append(dst, h)
		}
	}
	return dst, false
}
