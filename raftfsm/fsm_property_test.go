package raftfsm

import (
	"bytes"
	"errors"
	"fmt"
	"maps"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/hashicorp/raft"
	"github.com/kvrouter/kvrouter/indexer"
	"github.com/kvrouter/kvrouter/kvevent"
	"pgregory.net/rapid"
)

// fsmModel is the reference of the FSM's own rules (the index has its own
// model): per-rank cursors with duplicate and gap handling, the publisher
// incarnation fence (a rank keeps its last dump's incarnation; a batch of
// another non-zero one applies nothing), the worker table, and every booking with the load it puts on its rank, computed here
// from the bookings alone (semantics.md §6), not read back from Sequences,
// with the sweeps that end bookings and drop tombstones by age, the
// cluster settings (a later one replaces the whole; one of weights no build
// writes is skipped), the member table, and the
// reply of each command it computes (acks, a booking's outcome, a sweep's
// count, the ranks a removal or a deregistration took).
// Which events reach the index, in which order, and what a registration or
// a deregistration does to a rank's index state are the FSM's rules too:
// ix is an index fed only what the model says reaches the FSM's (the events
// up to each gap, past the duplicates; capacities; removed ranks), so a
// stray event (one past a gap held as an orphan) or a rank kept or dropped
// wrongly shows.
type fsmModel struct {
	ix       *indexer.Index
	cursors  map[kvevent.Rank]uint64
	incs     map[kvevent.Rank]uint64 // the incarnation of each rank's last dump
	workers  map[uint64]WorkerInfo
	bookings map[string]*fsmModelBooking // live
	freed    map[string]int64            // tombstones (their bookings' times): an add of these books nothing
	now      int64                       // the time the next command carries
	settings Settings
	members  map[string]Member
	// replies holds each generated command's reply as the model computes
	// it, in order, for checkReplies; anyReply where it checks none.
	replies []interface{}
}

// anyReply stands for a reply the model does not compute.
type anyReply struct{}

// skippedReply stands for the reply of an entry the FSM skips as garbled
// (ErrBadCommand): an error, whatever its text.
type skippedReply struct{}

func newFSMModel() *fsmModel {
	return &fsmModel{ix: indexer.New(indexer.Config{}), cursors: map[kvevent.Rank]uint64{}, incs: map[kvevent.Rank]uint64{},
		workers: map[uint64]WorkerInfo{}, bookings: map[string]*fsmModelBooking{}, freed: map[string]int64{}, now: fsmNow,
		settings: Settings{Params: indexer.DefaultParams()}, members: map[string]Member{}}
}

// checkReplies compares the replies of a batch just applied with the
// model's, and takes the model's off.
func (m *fsmModel) checkReplies(rt *rapid.T, what string, got []interface{}) {
	if len(got) > len(m.replies) {
		rt.Fatalf("%s: %d replies, the model has %d", what, len(got), len(m.replies))
	}
	for i, g := range got {
		want := m.replies[i]
		if _, ok := want.(anyReply); ok {
			continue
		}
		if _, ok := want.(skippedReply); ok {
			if err, isErr := g.(error); !isErr || !errors.Is(err, ErrBadCommand) {
				rt.Fatalf("%s: reply %v, model a skipped entry (ErrBadCommand)", what, responseString(g))
			}
			continue
		}
		if responseString(g) != responseString(want) {
			rt.Fatalf("%s: reply %v, model %v", what, responseString(g), responseString(want))
		}
	}
	m.replies = m.replies[len(got):]
}

// fsmModelBooking is one live booking as the model keeps it.
type fsmModelBooking struct {
	rank        kvevent.Rank
	hashes      []uint64 // the add's, then each new output block's
	isl, cached int
	prefillDone bool
	discount    uint32 // parts per DecayScale off each block it alone holds
	createdAt   int64
}

// fsmNow is the time of the first generated command; each next one's is
// up to 3s later, so that sweeps (encodeExpire) find bookings, tombstones
// and held stores both older and younger than their cutoffs.
const fsmNow = 5

// fsmRanks are the ranks the generated commands name.
var fsmRanks = []kvevent.Rank{{Worker: 1}, {Worker: 1, DP: 1}, {Worker: 2}, {Worker: 2, DP: 1}}

// fsmStrayRanks are ranks a removal names that nothing else does: no
// worker's registration lists them and no command gives them state.
var fsmStrayRanks = []kvevent.Rank{{Worker: 1, DP: 2}, {Worker: 3}}

// fsmMembers are the member ids the generated member commands name; ""
// too, which no node's own id is but a log may hold.
var fsmMembers = []string{"n1", "n2", "n3", ""}

// fsmRequests are the request ids the generated bookings name.
var fsmRequests = []string{"a", "b", "c", "d"}

// free ends the live booking of id, leaving a tombstone.
func (m *fsmModel) free(id string) {
	if b, ok := m.bookings[id]; ok {
		delete(m.bookings, id)
		m.freed[id] = b.createdAt
	}
}

// removeRanks drops the cursors and frees the bookings of every rank match
// takes, as a deregistration (or a registration without the rank) does.
func (m *fsmModel) removeRanks(match func(kvevent.Rank) bool) {
	for r := range m.cursors {
		if match(r) {
			delete(m.cursors, r)
			delete(m.incs, r)
		}
	}
	for id, b := range m.bookings {
		if match(b.rank) {
			m.free(id)
		}
	}
}

// removeHeld removes the ranks match takes as removeRanks does, from the
// index too, and returns how many of them held index state or a cursor
// (what a removal or a deregistration answers).
func (m *fsmModel) removeHeld(match func(kvevent.Rank) bool) int {
	n := 0
	for _, r := range fsmRanks {
		_, cursor := m.cursors[r]
		if match(r) && (m.ix.RemoveRank(r) || cursor) {
			n++
		}
	}
	m.removeRanks(match)
	return n
}

// unlisted says whether r's worker is registered Positional without r: r
// takes neither events nor dumps.
func (m *fsmModel) unlisted(r kvevent.Rank) bool {
	w, ok := m.workers[r.Worker]
	return ok && w.Positional && !slices.Contains(w.DPRanks, r.DP)
}

// load is rank's load by the rules of semantics.md §6, from scratch: the
// live requests, the uncached input tokens of those still in prefill, and
// the distinct blocks they hold, where a block that one request alone holds
// counts 1 - discount/DecayScale of a block, and the sum is rounded half up.
func (m *fsmModel) load(r kvevent.Rank) indexer.Load {
	var l indexer.Load
	holders := map[uint64][]*fsmModelBooking{}
	for _, b := range m.bookings {
		if b.rank != r {
			continue
		}
		l.ActiveRequests++
		if !b.prefillDone && b.isl > b.cached {
			l.ActivePrefillTokens += int64(b.isl - b.cached)
		}
		for _, h := range b.hashes {
			holders[h] = append(holders[h], b)
		}
	}
	var ppm int64
	for _, hs := range holders {
		ppm += indexer.DecayScale
		if len(hs) == 1 {
			ppm -= int64(hs[0].discount)
		}
	}
	l.ActiveDecodeBlocks = (ppm + indexer.DecayScale/2) / indexer.DecayScale
	return l
}

// check compares f with the model: every named rank's cursor and load,
// every request's booking, and the worker table.
func (m *fsmModel) check(rt *rapid.T, what string, f *FSM) {
	// Every rank the commands name, so that a cursor or a load the FSM
	// kept and the model dropped (a worker's removal) is compared too.
	for _, r := range fsmRanks {
		if got, c := f.Cursor(r), m.cursors[r]; got != c {
			rt.Fatalf("%s: cursor of %v = %d, model %d", what, r, got, c)
		}
		if got, inc := f.Incarnation(r), m.incs[r]; got != inc {
			rt.Fatalf("%s: incarnation of %v = %d, model %d", what, r, got, inc)
		}
		if got, want := f.Sequences().Load(r), m.load(r); got != want {
			rt.Fatalf("%s: load of %v = %+v, model %+v", what, r, got, want)
		}
	}
	for _, id := range fsmRequests {
		got, live := f.Sequences().Get(id)
		want, ok := m.bookings[id]
		if live != ok {
			rt.Fatalf("%s: booking %q live %v, model %v", what, id, live, ok)
		}
		if !ok {
			continue
		}
		if got.Rank != want.rank || !slices.Equal(got.SeqHashes, want.hashes) || got.ISL != want.isl ||
			got.CachedTokens != want.cached || got.PrefillDone != want.prefillDone || got.Discount != want.discount || got.CreatedAt != want.createdAt {
			rt.Fatalf("%s: booking %q = %+v, model %+v", what, id, got, *want)
		}
	}
	if live, freed := f.Sequences().Count(); live != len(m.bookings) || freed != len(m.freed) {
		rt.Fatalf("%s: live bookings %d tombstones %d, model %d and %d", what, live, freed, len(m.bookings), len(m.freed))
	}
	// The index: each rank's figures (blocks per tier, capacity, held
	// orphans, its resync and capacity flags), then the digest of every
	// residency and orphan.
	if got, want := f.Index().RankStats(), m.ix.RankStats(); !slices.Equal(got, want) {
		rt.Fatalf("%s: index ranks %+v, model %+v", what, got, want)
	}
	if got, want := f.Index().Digest(), m.ix.Digest(); got != want {
		rt.Fatalf("%s: index digest %#x, model %#x", what, got, want)
	}
	// The settings bit for bit (a -0 weight stays -0), and the member
	// table, which the digest leaves out: only this compares it.
	if got, want := f.Settings(), m.settings; responseString(got) != responseString(want) {
		rt.Fatalf("%s: settings %+v, model %+v", what, got, want)
	}
	if got := f.Members(); !maps.Equal(got, m.members) {
		rt.Fatalf("%s: members %+v, model %+v", what, got, m.members)
	}
	ws := f.Workers()
	if len(ws) != len(m.workers) {
		rt.Fatalf("%s: workers %v, model %v", what, ws, m.workers)
	}
	for id, want := range m.workers {
		got, ok := ws[id]
		if !ok || got.ID != want.ID || !slices.Equal(got.DPRanks, want.DPRanks) || got.BlockSize != want.BlockSize || got.Capacity != want.Capacity || got.Positional != want.Positional {
			rt.Fatalf("%s: worker %d = %+v (registered %v), model %+v", what, id, got, ok, want)
		}
	}
	// What ApplyBatch published at its end (publishWorkers): the route
	// candidates and the block size, against a rebuild from the model's
	// table, and the apply path's own table.
	var rebuilt FSM
	rebuilt.setWorkers(maps.Clone(m.workers))
	got, want := f.published(), rebuilt.published()
	if !slices.Equal(got.cands, want.cands) {
		rt.Fatalf("%s: route candidates %+v, rebuilt from the table %+v", what, got.cands, want.cands)
	}
	if got.blockSize != want.blockSize || got.blockSizeFrom != want.blockSizeFrom || got.hasBlockSize != want.hasBlockSize || got.blockSizePlain != want.blockSizePlain {
		rt.Fatalf("%s: block size %d of worker %d (%v, without a model %v), rebuilt %d of worker %d (%v, %v)", what,
			got.blockSize, got.blockSizeFrom, got.hasBlockSize, got.blockSizePlain, want.blockSize, want.blockSizeFrom, want.hasBlockSize, want.blockSizePlain)
	}
	if !slices.Equal(got.routeCands, want.routeCands) {
		rt.Fatalf("%s: /v1 route candidates %+v, rebuilt from the table %+v", what, got.routeCands, want.routeCands)
	}
	if !maps.EqualFunc(f.wtab, ws, func(a, b WorkerInfo) bool {
		return a.ID == b.ID && slices.Equal(a.DPRanks, b.DPRanks) && a.BlockSize == b.BlockSize
	}) {
		rt.Fatalf("%s: published workers %v, the apply path's %v", what, ws, f.wtab)
	}
}

func genFSMCommand(t *rapid.T, m *fsmModel) []byte {
	ranks := fsmRanks
	// Incarnations: 0 (unfenced) and two publishers'.
	incarnation := rapid.SampledFrom([]uint64{0, 1, 2})
	// Time moves on (never back: the tracker's clamp to its last sweep
	// is booking_clock_test.go's).
	m.now += rapid.SampledFrom([]int64{0, 0, 1e6, 5e8, 3e9}).Draw(t, "dt")
	now := m.now
	switch rapid.IntRange(0, 17).Draw(t, "cmd") {
	case 0, 1, 2, 3:
		var batches []RankBatch
		for _, r := range rapid.SliceOfNDistinct(rapid.SampledFrom(ranks), 1, 3, func(r kvevent.Rank) kvevent.Rank { return r }).Draw(t, "ranks") {
			// Start near the cursor: duplicates, the next id, or a gap.
			first := m.cursors[r] + 1 + uint64(rapid.IntRange(-2, 1).Draw(t, "offset"))
			if int64(first) < 1 {
				first = 1
			}
			n := rapid.IntRange(1, 4).Draw(t, "n")
			batches = append(batches, RankBatch{Rank: r, Incarnation: incarnation.Draw(t, "incarnation"), Events: chainEvents(r, first, n, first*7)})
		}
		acks := make([]RankAck, 0, len(batches))
		for _, b := range batches {
			if m.unlisted(b.Rank) {
				// Its Positional worker does not list it: nothing applies.
				acks = append(acks, RankAck{Rank: b.Rank, Unregistered: true})
				continue
			}
			ack := RankAck{Rank: b.Rank, Cursor: m.cursors[b.Rank]}
			if s := m.incs[b.Rank]; b.Incarnation != 0 && s != 0 && b.Incarnation != s {
				// Fenced: nothing applies.
				ack.Resync, ack.Fenced = true, true
				acks = append(acks, ack)
				continue
			}
			// A Positional worker's ids are positions: a hole is no gap.
			positional := m.workers[b.Rank.Worker].Positional
			for i := range b.Events {
				ev := &b.Events[i]
				if ev.EventID <= ack.Cursor {
					ack.Dups++
					continue
				}
				if ev.EventID != ack.Cursor+1 && !positional {
					ack.Gap = true
					break
				}
				_ = m.ix.Apply(ev, now)
				ack.Cursor = ev.EventID
				ack.Applied++
			}
			if ack.Applied > 0 {
				m.cursors[b.Rank] = ack.Cursor
			}
			ack.Resync = m.ix.RankNeedsResync(b.Rank)
			acks = append(acks, ack)
		}
		m.replies = append(m.replies, acks)
		return encodeEvents(now, batches)
	case 4:
		// A registration, or a registration again with other ranks and
		// capacity: a rank it drops goes with its cursor and bookings. A
		// Positional one drops every rank of the worker it does not list,
		// listed before or not (the state of a dump or events taken while
		// the worker was unregistered or not Positional).
		w := WorkerInfo{
			ID:        uint64(rapid.IntRange(1, 2).Draw(t, "worker")),
			DPRanks:   rapid.SampledFrom([][]uint32{{0, 1}, {0}, {1}, {1, 0}}).Draw(t, "dp ranks"),
			BlockSize: rapid.SampledFrom([]int{16, 32}).Draw(t, "block size"),
			// A model's worker sets the /v1 block size only when no worker
			// without one has one (blockSizeOf).
			Model:      rapid.SampledFrom([]string{"", "m"}).Draw(t, "model"),
			Capacity:   [4]int64{rapid.Int64Range(1, 3).Draw(t, "capacity") * 64},
			Positional: rapid.Bool().Draw(t, "positional"),
		}
		prev, known := m.workers[w.ID]
		drops := func(r kvevent.Rank) bool {
			if r.Worker != w.ID || slices.Contains(w.DPRanks, r.DP) {
				return false
			}
			return w.Positional || known && slices.Contains(prev.DPRanks, r.DP)
		}
		m.removeRanks(drops)
		for _, r := range fsmRanks {
			if drops(r) {
				m.ix.RemoveRank(r)
			}
		}
		m.workers[w.ID] = w
		for _, dp := range w.DPRanks {
			m.ix.SetCapacity(kvevent.Rank{Worker: w.ID, DP: dp}, w.Capacity)
		}
		m.replies = append(m.replies, anyReply{})
		return encodeRegister(now, &w)
	case 5:
		// A deregistration, of a worker never registered (3) too: it
		// removes the worker's ranks' state all the same, and answers how
		// many held some, as an int or, for a worker not registered, in an
		// unknownWorkerError.
		id := uint64(rapid.IntRange(1, 3).Draw(t, "worker"))
		_, known := m.workers[id]
		delete(m.workers, id)
		removed := m.removeHeld(func(r kvevent.Rank) bool { return r.Worker == id })
		m.ix.RemoveWorker(id)
		if known {
			m.replies = append(m.replies, removed)
		} else {
			m.replies = append(m.replies, &unknownWorkerError{id: id, removed: removed})
		}
		return encodeDeregister(now, id)
	case 14:
		// The removal of unregistered ranks (the leader's sweep), as the
		// leader lists them or stale: a rank a registration lists keeps
		// its state, one listed twice is removed once, a stray one holds
		// nothing. It answers how many held index state or a cursor.
		pick := rapid.SampledFrom(append(slices.Clone(fsmRanks), fsmStrayRanks...))
		ranks := rapid.SliceOfN(pick, 0, 3).Draw(t, "removed ranks")
		removed := m.removeHeld(func(r kvevent.Rank) bool {
			return slices.Contains(ranks, r) && !slices.Contains(m.workers[r.Worker].DPRanks, r.DP)
		})
		m.replies = append(m.replies, removed)
		return encodeRemoveRanks(now, ranks)
	case 15:
		// Cluster settings: valid ones replace the whole (weights above
		// MaxWeight included: an older build wrote them; -0 kept as it
		// is); one NaN, infinite or negative weight, or a negative busy
		// prefill count, makes an entry no build writes, skipped.
		weight := rapid.SampledFrom([]float64{0, math.Copysign(0, -1), 0.25, 1, 3, 2 * indexer.MaxWeight})
		var s Settings
		p := &s.Params
		fields := []*float64{&p.OverlapScoreCredit, &p.HostCacheHitWeight, &p.DiskCacheHitWeight, &p.PrefillLoadScale,
			&p.DecodeActiveRequestWeight, &p.Temperature, &p.BusyDecodeFraction}
		for _, f := range fields {
			*f = weight.Draw(t, "weight")
		}
		p.BusyPrefillTokens = rapid.SampledFrom([]int64{0, 512}).Draw(t, "busy prefill tokens")
		s.View = rapid.SampledFrom([]indexer.View{indexer.ViewDedup, indexer.ViewTiered}).Draw(t, "view")
		if rapid.IntRange(0, 3).Draw(t, "bad settings?") == 0 {
			if bad := rapid.IntRange(0, len(fields)).Draw(t, "bad field"); bad == len(fields) {
				p.BusyPrefillTokens = -1
			} else {
				*fields[bad] = rapid.SampledFrom([]float64{math.NaN(), math.Inf(1), math.Inf(-1), -1}).Draw(t, "bad weight")
			}
			m.replies = append(m.replies, skippedReply{})
			return encodeSettings(now, &s)
		}
		m.settings = s
		m.replies = append(m.replies, nil)
		return encodeSettings(now, &s)
	case 16:
		// A member's entry, new or replacing the one of its id, with
		// either address empty or not; one whose id is past maxKeyID is
		// garbled, skipped.
		mb := Member{ID: rapid.SampledFrom(fsmMembers).Draw(t, "member"),
			RaftAddr: rapid.SampledFrom([]string{"", "10.0.0.1:7000", "10.0.0.2:7000"}).Draw(t, "raft addr"),
			HTTPAddr: rapid.SampledFrom([]string{"", "10.0.0.1:8080", "[::1]:8080"}).Draw(t, "http addr")}
		if rapid.IntRange(0, 7).Draw(t, "long member id?") == 0 {
			mb.ID = strings.Repeat("n", maxKeyID+1)
			m.replies = append(m.replies, skippedReply{})
			return encodeMember(now, &mb)
		}
		m.members[mb.ID] = mb
		m.replies = append(m.replies, nil)
		return encodeMember(now, &mb)
	case 17:
		// A member's removal, of an id in the table or not (nothing to
		// remove); one past maxKeyID is garbled, skipped.
		id := rapid.SampledFrom(fsmMembers).Draw(t, "member")
		if rapid.IntRange(0, 7).Draw(t, "long member id?") == 0 {
			m.replies = append(m.replies, skippedReply{})
			return encodeMemberGone(now, strings.Repeat("n", maxKeyID+1))
		}
		delete(m.members, id)
		m.replies = append(m.replies, nil)
		return encodeMemberGone(now, id)
	case 6, 7:
		rid := rapid.SampledFrom(fsmRequests).Draw(t, "request")
		r := rapid.SampledFrom(ranks).Draw(t, "rank")
		b := Booking{ID: rid, Rank: r,
			SeqHashes:    rapid.SliceOfNDistinct(rapid.Uint64Range(1, 6), 0, 4, func(h uint64) uint64 { return h }).Draw(t, "hashes"),
			ISL:          rapid.IntRange(0, 64).Draw(t, "isl"),
			CachedTokens: rapid.IntRange(0, 48).Draw(t, "cached")}
		// A rank no registered worker has books nothing (its worker left
		// between the route's decision and the commit), and neither does a
		// live or freed id.
		// The reply is the booking as it stands: the first add's rank.
		w, registered := m.workers[r.Worker]
		_, freed := m.freed[rid]
		want := bookOutcome{rank: r, left: true}
		if registered && slices.Contains(w.DPRanks, r.DP) {
			if _, live := m.bookings[rid]; !live && !freed {
				m.bookings[rid] = &fsmModelBooking{rank: r, hashes: slices.Clone(b.SeqHashes), isl: b.ISL, cached: b.CachedTokens, createdAt: now}
			}
			want = bookOutcome{freed: freed}
			if mb, live := m.bookings[rid]; live {
				want = bookOutcome{rank: mb.rank, live: true}
			}
		}
		m.replies = append(m.replies, want)
		return encodeBook(now, []bookOp{{kind: bookAdd, b: b}})
	case 8:
		// An output block with a decay weight: the booking's discount must
		// survive a reopen and a snapshot like the rest of it.
		rid := rapid.SampledFrom(fsmRequests).Draw(t, "request")
		h := rapid.Uint64Range(1, 8).Draw(t, "output hash")
		ops := []bookOp{{kind: bookOutput, b: Booking{ID: rid, SeqHashes: []uint64{h}}}}
		if b, ok := m.bookings[rid]; ok && !slices.Contains(b.hashes, h) {
			b.hashes = append(b.hashes, h)
		}
		if rapid.Bool().Draw(t, "decay") {
			d := uint32(rapid.IntRange(0, 4).Draw(t, "quarters")) * indexer.DecayScale / 4
			ops = append(ops, bookOp{kind: bookDecay, b: Booking{ID: rid, Discount: d}})
			if b, ok := m.bookings[rid]; ok {
				b.discount = d
			}
		}
		m.replies = append(m.replies, nil)
		return encodeBook(now, ops)
	case 9:
		rid := rapid.SampledFrom(fsmRequests).Draw(t, "request")
		if b, ok := m.bookings[rid]; ok {
			b.prefillDone = true
		}
		m.replies = append(m.replies, nil)
		return encodeBook(now, []bookOp{{kind: bookPrefillDone, b: Booking{ID: rid}}})
	case 12:
		// A rank dump: taken at or above the cursor (it replaces the rank
		// and sets its cursor and incarnation), refused below it.
		r := rapid.SampledFrom(ranks).Draw(t, "rank")
		cursor := m.cursors[r] + uint64(rapid.IntRange(0, 3).Draw(t, "cursor offset"))
		if cursor > 0 {
			cursor-- // one below the cursor (stale) to two past it
		}
		inc := incarnation.Draw(t, "incarnation")
		stored := chainEvents(r, 1, rapid.IntRange(0, 3).Draw(t, "stored"), 100+cursor*11)
		switch {
		case m.unlisted(r):
			m.replies = append(m.replies, RankAck{Rank: r, Unregistered: true})
		case cursor < m.cursors[r]:
			m.replies = append(m.replies, RankAck{Rank: r, Cursor: m.cursors[r]})
		default:
			bad := m.ix.ReplaceRank(r, stored, now)
			m.cursors[r], m.incs[r] = cursor, inc
			m.replies = append(m.replies, RankAck{Rank: r, Cursor: cursor, Applied: len(stored) - bad})
		}
		return encodeReplace(now, r, cursor, inc, stored)
	case 13:
		// The replicated sweep: it ends the live bookings made before its
		// cutoff (no tombstone), drops the tombstones of bookings made
		// before it, and ages the index's held stores out.
		maxAge := rapid.SampledFrom([]int64{1e9, 4e9, 30e9}).Draw(t, "max age")
		expired := 0
		for id, b := range m.bookings {
			if b.createdAt < now-maxAge {
				delete(m.bookings, id)
				expired++
			}
		}
		for id, at := range m.freed {
			if at < now-maxAge {
				delete(m.freed, id)
			}
		}
		m.ix.ExpireOrphans(now)
		m.replies = append(m.replies, expired)
		return encodeExpire(now, maxAge)
	default:
		rid := rapid.SampledFrom(fsmRequests).Draw(t, "request")
		m.free(rid)
		m.replies = append(m.replies, nil)
		return encodeBook(now, []bookOp{{kind: bookFree, b: Booking{ID: rid}}})
	}
}

// TestFSMMatchesModelAndSurvivesReopenAndSnapshot applies random commands
// in random batches, checking the FSM and the batch's replies against the
// model after each, and then that a
// reopen and a snapshot/restore both give the same digest (the snapshot
// passing the check before a user restore).
func TestFSMMatchesModelAndSurvivesReopenAndSnapshot(t *testing.T) {
	rounds := 1
	if os.Getenv("KVROUTER_LONG") != "" {
		rounds = 20 // make test-long
	}
	for range rounds {
		checkFSMMatchesModel(t)
	}
}

func checkFSMMatchesModel(t *testing.T) {
	rapid.Check(t, func(rt *rapid.T) {
		dir := filepath.Join(t.TempDir(), "fsm")
		f, err := OpenFSM(FSMConfig{Dir: dir, Logger: quiet, OnFatal: func(err error) { rt.Fatalf("fatal: %v", err) }})
		if err != nil {
			rt.Fatal(err)
		}
		// Closed however the run ends (a run rapid finds invalid ends at a
		// draw); Close is idempotent.
		defer f.Close()
		m := newFSMModel()
		defer m.ix.Release()
		var w logWriter
		var pending []*raft.Log
		// The model is checked after every batch, replies included: a
		// wrong state a later command hides (a booking a sweep should
		// have ended, freed afterwards) shows.
		for i, n := 0, rapid.IntRange(20, 80).Draw(rt, "commands"); i < n; i++ {
			pending = append(pending, w.next(genFSMCommand(rt, m)))
			if rapid.Bool().Draw(rt, "flush") {
				what := fmt.Sprintf("after command %d", i)
				m.checkReplies(rt, what, f.ApplyBatch(pending))
				m.check(rt, what, f)
				pending = nil
			}
		}
		m.checkReplies(rt, "applied", f.ApplyBatch(pending))
		m.check(rt, "applied", f)
		d := f.Digest()
		if !rapid.Bool().Draw(rt, "checkDurability") {
			f.Close() // durability round trips cost a few Pebble opens: check half the runs
			return
		}
		saved := viewBytes(t, f) // a user's save: the open group laid over the database
		snap := snapshotBytes(t, f)
		if !bytes.Equal(saved, snap) {
			rt.Fatal("a save's stream differs from Raft's snapshot of the same state")
		}
		// What the FSM writes is what the check before a user restore
		// wants: one record per item, under its key.
		if _, err := checkSnapshot(bytes.NewReader(snap), indexer.New(indexer.Config{})); err != nil {
			rt.Fatalf("check of the FSM's own snapshot: %v", err)
		}
		if err := f.db.Sync(); err != nil {
			rt.Fatal(err)
		}
		f.Close()
		g, err := OpenFSM(FSMConfig{Dir: dir, Logger: quiet, OnFatal: func(err error) { rt.Fatalf("fatal: %v", err) }})
		if err != nil {
			rt.Fatal(err)
		}
		defer g.Close()
		if g.Digest() != d {
			rt.Fatalf("reopened digest %#x, want %#x", g.Digest(), d)
		}
		m.check(rt, "reopened", g)
		h, err := OpenFSM(FSMConfig{Dir: filepath.Join(t.TempDir(), "fsm"), Logger: quiet, OnFatal: func(err error) { rt.Fatalf("fatal: %v", err) }})
		if err != nil {
			rt.Fatal(err)
		}
		defer h.Close()
		if err := h.Restore(nopCloser{bytes.NewReader(snap)}); err != nil {
			rt.Fatal(err)
		}
		if h.Digest() != d {
			rt.Fatalf("restored digest %#x, want %#x", h.Digest(), d)
		}
		m.check(rt, "restored", h)
	})
}

// TestBatchBoundariesDoNotChangeTheState: one log (with check entries that
// carry the single-entry replica's last check) applied entry by entry and
// in random batches gives equal responses, digests and no mismatch.
// Replicas apply one log in different batches (a leader's, a follower's, a
// replay's), and what the apply path keeps per batch (the worker table,
// published at a batch's end) must not show.
func TestBatchBoundariesDoNotChangeTheState(t *testing.T) {
	rapid.Check(t, func(rt *rapid.T) {
		open := func() *FSM {
			f, err := OpenFSM(FSMConfig{Dir: filepath.Join(t.TempDir(), "fsm"), Logger: quiet, OnFatal: func(err error) { rt.Fatalf("fatal: %v", err) }})
			if err != nil {
				rt.Fatal(err)
			}
			return f
		}
		a, b := open(), open()
		defer a.Close()
		defer b.Close()
		m := newFSMModel()
		defer m.ix.Release()
		var w logWriter
		var logs []*raft.Log
		var outA []interface{}
		for i, n := 0, rapid.IntRange(1, 60).Draw(rt, "commands"); i < n; i++ {
			var data []byte
			if rapid.IntRange(0, 4).Draw(rt, "check?") == 0 {
				lc := a.LastCheck()
				data = encodeCheck(m.now, lc.Index, lc.Digest)
			} else {
				data = genFSMCommand(rt, m)
			}
			l := w.next(data)
			logs = append(logs, l)
			outA = append(outA, a.ApplyBatch([]*raft.Log{l})[0])
		}
		var outB []interface{}
		for len(logs) > 0 {
			k := rapid.IntRange(1, len(logs)).Draw(rt, "batch")
			outB = append(outB, b.ApplyBatch(logs[:k])...)
			logs = logs[k:]
		}
		for i := range outA {
			if responseString(outA[i]) != responseString(outB[i]) {
				rt.Fatalf("entry %d: response %v one by one, %v batched", i, outA[i], outB[i])
			}
		}
		if _, mm := b.DigestChecks(); mm != 0 {
			rt.Fatalf("%d digest mismatches on the batched replica", mm)
		}
		if a.Digest() != b.Digest() || a.LastCheck() != b.LastCheck() {
			rt.Fatalf("digest %x/%x last check %v/%v", a.Digest(), b.Digest(), a.LastCheck(), b.LastCheck())
		}
	})
}

// responseString prints an entry's response, pointers' targets included.
func responseString(v interface{}) string { return fmt.Sprintf("%#v", v) }
