// Package apitest provides an in-memory fake of the node behind the API
// (api.Backend), for the tests of the API, its client and kvctl.
//
// The fake keeps just enough state to answer like a node: workers, per-rank
// event cursors with duplicate and gap handling, which content hashes each
// rank holds per tier, bookings, members and settings. It scores routes
// with the real indexer.Select. It can play the leader or a follower (whose
// writes fail with a *raftfsm.NotLeaderError), and fail any method on
// demand. It snapshots to a small self-checking format that InspectSnapshot
// reads.
//
// Every method records its call and re-validates what it got: a test can
// assert that nothing malformed reached the backend (Malformed) and that a
// refused request reached nothing at all (Calls).
package apitest

import (
	"bufio"
	"bytes"
	"cmp"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"maps"
	"math/rand/v2"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/kvrouter/kvrouter/indexer"
	"github.com/kvrouter/kvrouter/kvevent"
	"github.com/kvrouter/kvrouter/raftfsm"
)

// DefaultBlockSize is the block size routes use before any worker is
// registered.
const DefaultBlockSize = 16

// Fake is an in-memory api.Backend. The zero value is not usable; call New.
type Fake struct {
	mu       sync.Mutex
	status   raftfsm.NodeStatus
	members  []raftfsm.Member
	workers  map[uint64]raftfsm.WorkerInfo
	ranks    map[kvevent.Rank]*rankState
	bookings map[string]*booking
	settings raftfsm.Settings
	restores int

	hook      func(method string) error
	calls     map[string]int
	malformed int
	// snapshotFailAfter, when > 0, makes SaveSnapshot fail after writing
	// that many bytes.
	snapshotFailAfter int
	snapshotFailErr   error // what it fails with; nil: a disk read failed
}

type rankState struct {
	Cursor uint64                  `json:"cursor"`
	Held   map[uint64]kvevent.Mask `json:"held"`   // content hash -> tiers
	Engine map[uint64]uint64       `json:"engine"` // engine hash -> content hash
}

type booking struct {
	rank    kvevent.Rank
	isl     int
	cached  int      // of isl, the tokens the rank held when booked
	seq     []uint64 // the sequence hashes of the request's full blocks
	prefill bool
}

// New returns a fake that is the ready leader of a one-node cluster, at
// httpAddr.
func New(id, httpAddr string) *Fake {
	f := &Fake{
		workers:  map[uint64]raftfsm.WorkerInfo{},
		ranks:    map[kvevent.Rank]*rankState{},
		bookings: map[string]*booking{},
		calls:    map[string]int{},
		settings: raftfsm.Settings{Params: indexer.DefaultParams()},
	}
	f.status = raftfsm.NodeStatus{
		ID: id, RaftAddr: id + ":7946", HTTPAddr: httpAddr, State: "Leader",
		Term: 2, LastIndex: 10, CommitIndex: 10, AppliedIndex: 10,
		LeaderID: id, LeaderHTTP: httpAddr, LastContactMs: 0, SnapshotIndex: 8,
		Digest: "00000000deadbeef", Ready: true,
	}
	f.members = []raftfsm.Member{{ID: id, RaftAddr: id + ":7946", HTTPAddr: httpAddr, Voter: true, Leader: true}}
	return f
}

// SetFollower makes the fake a follower of leaderID at leaderHTTP (""
// when no leader is known): every write fails with a *raftfsm.NotLeaderError.
func (f *Fake) SetFollower(leaderID, leaderHTTP string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.status.State = "Follower"
	f.status.LeaderID, f.status.LeaderHTTP = leaderID, leaderHTTP
	f.status.LastContactMs = 12
}

// SetLeader makes the fake the leader again.
func (f *Fake) SetLeader() {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.status.State = "Leader"
	f.status.LeaderID, f.status.LeaderHTTP = f.status.ID, f.status.HTTPAddr
	f.status.LastContactMs = 0
}

// SetReady sets what Status reports as Ready.
func (f *Fake) SetReady(ready bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.status.Ready = ready
}

// SetStatus replaces the whole status (tests of kvctl status).
func (f *Fake) SetStatus(st raftfsm.NodeStatus) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.status = st
}

// SetMembers replaces the member table.
func (f *Fake) SetMembers(ms []raftfsm.Member) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.members = slices.Clone(ms)
}

// SetHook installs a function called first by every method with the
// method's name; a non-nil error is returned by the method as is.
func (f *Fake) SetHook(hook func(method string) error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.hook = hook
}

// FailSnapshotAfter makes SaveSnapshot fail after writing n bytes (0: never).
func (f *Fake) FailSnapshotAfter(n int) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.snapshotFailAfter, f.snapshotFailErr = n, nil
}

// FailSnapshotWith makes SaveSnapshot fail with err after writing n bytes
// (0: never), as a save a restore cut off fails (raftfsm.ErrStateReplaced).
func (f *Fake) FailSnapshotWith(n int, err error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.snapshotFailAfter, f.snapshotFailErr = n, err
}

// Calls returns how many times each method was called.
func (f *Fake) Calls() map[string]int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return maps.Clone(f.calls)
}

// Malformed returns how many events that fail kvevent.Event.Validate, or
// other malformed arguments, reached the fake.
func (f *Fake) Malformed() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.malformed
}

// Settings returns the last settings set.
func (f *Fake) Settings() raftfsm.Settings {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.settings
}

// Bookings returns the ids of the live bookings and whether each is still
// in prefill.
func (f *Fake) Bookings() map[string]bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	out := map[string]bool{}
	for id, b := range f.bookings {
		out[id] = b.prefill
	}
	return out
}

// Restores returns how many snapshots were installed.
func (f *Fake) Restores() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.restores
}

// enter records a call and runs the hook; f.mu is held on return when err
// is nil.
func (f *Fake) enter(method string, write bool) error {
	f.mu.Lock()
	f.calls[method]++
	if f.hook != nil {
		hook := f.hook
		f.mu.Unlock()
		if err := hook(method); err != nil {
			return err
		}
		f.mu.Lock()
	}
	if write && f.status.State != "Leader" {
		err := &raftfsm.NotLeaderError{LeaderID: f.status.LeaderID, LeaderHTTP: f.status.LeaderHTTP}
		f.mu.Unlock()
		return err
	}
	return nil
}

// Status implements api.Backend.
func (f *Fake) Status() raftfsm.NodeStatus {
	if err := f.enter("Status", false); err != nil {
		return raftfsm.NodeStatus{}
	}
	defer f.mu.Unlock()
	return f.status
}

// Readiness implements api.Backend: Status, whose hooks and value it
// shares (a fake does not block).
func (f *Fake) Readiness() raftfsm.NodeStatus { return f.Status() }

// Members implements api.Backend.
func (f *Fake) Members(ctx context.Context) ([]raftfsm.Member, error) {
	if err := f.enter("Members", false); err != nil {
		return nil, err
	}
	defer f.mu.Unlock()
	return slices.Clone(f.members), nil
}

// Workers implements api.Backend.
func (f *Fake) Workers() []raftfsm.WorkerStatus {
	if err := f.enter("Workers", false); err != nil {
		return nil
	}
	defer f.mu.Unlock()
	var out []raftfsm.WorkerStatus
	for _, id := range slices.Sorted(maps.Keys(f.workers)) {
		w := f.workers[id]
		ws := raftfsm.WorkerStatus{Info: w}
		for _, dp := range dpRanks(w) {
			r := kvevent.Rank{Worker: id, DP: dp}
			l, _ := f.load(r, nil)
			rs := raftfsm.RankStatus{DPRank: dp, Load: l}
			if st := f.ranks[r]; st != nil {
				rs.Cursor = st.Cursor
				for _, m := range st.Held {
					for t := range kvevent.Tier(kvevent.NumTiers) {
						if m.Has(t) {
							rs.Blocks[t]++
						}
					}
				}
			}
			ws.Ranks = append(ws.Ranks, rs)
		}
		out = append(out, ws)
	}
	return out
}

// IndexStats implements api.Backend.
func (f *Fake) IndexStats() indexer.Stats {
	if err := f.enter("IndexStats", false); err != nil {
		return indexer.Stats{}
	}
	defer f.mu.Unlock()
	var s indexer.Stats
	nodes := map[uint64]struct{}{}
	for _, st := range f.ranks {
		if len(st.Held) == 0 {
			continue
		}
		s.Ranks++
		for h, m := range st.Held {
			nodes[h] = struct{}{}
			s.Entries++
			for t := range kvevent.Tier(kvevent.NumTiers) {
				if m.Has(t) {
					s.Blocks[t]++
					s.Counters.StoredBlocks++
				}
			}
		}
	}
	s.Nodes = int64(len(nodes))
	return s
}

func dpRanks(w raftfsm.WorkerInfo) []uint32 {
	if len(w.DPRanks) == 0 {
		return []uint32{0}
	}
	return w.DPRanks
}

// load returns rank r's load and its potential decode blocks for a
// request of sequence hashes seq, by the node's rules (indexer.Sequences,
// less its decay): the distinct blocks of r's live bookings, the uncached
// input of those in prefill, and the request's distinct blocks they do
// not hold added to the former.
func (f *Fake) load(r kvevent.Rank, seq []uint64) (indexer.Load, int64) {
	var l indexer.Load
	held := map[uint64]bool{}
	for _, b := range f.bookings {
		if b.rank != r {
			continue
		}
		l.ActiveRequests++
		for _, h := range b.seq {
			held[h] = true
		}
		if b.prefill {
			l.ActivePrefillTokens += int64(max(b.isl-b.cached, 0))
		}
	}
	l.ActiveDecodeBlocks = int64(len(held))
	potential := l.ActiveDecodeBlocks
	for _, h := range seq {
		if !held[h] {
			held[h] = true
			potential++
		}
	}
	return l, potential
}

// blockSize returns the block size routes hash with, by the node's rule:
// the smallest id's of the workers without a model, else the smallest
// id's of all, else DefaultBlockSize.
func (f *Fake) blockSize() int {
	bs, found, plain := DefaultBlockSize, false, false
	for _, id := range slices.Sorted(maps.Keys(f.workers)) {
		w := f.workers[id]
		p := w.Model == "" && w.Tenant == ""
		if w.BlockSize > 0 && (!found || p && !plain) {
			bs, found, plain = w.BlockSize, true, p
		}
	}
	return bs
}

// Route implements api.Backend: the overlap of each registered rank is the
// run of the request's leading blocks it holds in any tier, counted in the
// tier of each block's fastest copy; the choice is indexer.Select's. A
// brief route's decision holds the chosen candidate only, as the node's.
//
// As the node's: the bounds on the input length (isl), the block size
// (blockSize), the candidates (the workers of that block size), each
// rank's load and potential decode blocks (its bookings' distinct blocks
// plus the request's full blocks they lack), a
// booking's cached tokens, and a retry of a booked request id, which
// answers the rank its first try booked (indexer.Decision.Keep), busy or
// not, and books nothing more. Unlike the node's: the overlap is the
// tiered view's whatever the settings' View, no booking decays (SetDecay),
// a freed id leaves no tombstone (routed again with book, it is booked
// anew, where the node answers booked: false), the query's BlockSize,
// Filter and Prefer are ignored, and a sampled decision draws from a fixed
// seed.
func (f *Fake) Route(ctx context.Context, q raftfsm.RouteQuery) (raftfsm.RouteResult, error) {
	if err := f.enter("Route", q.Book); err != nil {
		return raftfsm.RouteResult{}, err
	}
	defer f.mu.Unlock()
	if err := ctx.Err(); q.Book && err != nil {
		return raftfsm.RouteResult{}, err // a booking waits on Raft under ctx, as the node's does
	}
	var res raftfsm.RouteResult
	// Tokens or hashes, not both; or neither with an ISL (a prompt shorter
	// than a block), as the node takes it.
	if len(q.Tokens) > 0 && len(q.LocalHashes) > 0 || len(q.Tokens) == 0 && len(q.LocalHashes) == 0 && q.ISL == 0 ||
		q.ISL < 0 || (q.Book && q.RequestID == "") {
		f.malformed++
		return res, fmt.Errorf("%w: route query", raftfsm.ErrInvalid)
	}
	bs := f.blockSize()
	res.BlockSize = bs
	hashes := q.LocalHashes
	if len(q.Tokens) > 0 {
		hashes = kvevent.LocalHashes(nil, q.Tokens, bs, kvevent.SeedFor(q.LoRA, q.Salt))
	}
	isl := q.ISL
	if isl == 0 {
		isl = cmp.Or(len(q.Tokens), len(hashes)*bs)
	}
	// The node's bounds on isl (raftfsm.Node.Route). The API refuses an isl
	// over MaxISL or below the token_ids' count itself, so only those are
	// malformed here; one below the block_hashes' tokens depends on the
	// cluster's block size, which the API does not know: it passes that
	// through to the node by design (docs/api.md), and the node's answer,
	// ErrInvalid, is the fake's too.
	if need := max(len(q.Tokens), len(hashes)*bs); isl < need || isl > raftfsm.MaxISL {
		if isl < len(q.Tokens) || isl > raftfsm.MaxISL {
			f.malformed++
		}
		return res, fmt.Errorf("%w: input length (isl) %d is below the prompt's %d tokens or over %d", raftfsm.ErrInvalid, isl, need, raftfsm.MaxISL)
	}
	req := indexer.Request{ISL: isl, BlockSize: bs, FirstBlockHash: raftfsm.RendezvousKey(hashes, q.Tokens, q.LoRA, q.Salt, q.RequestID)}
	seq := q.SeqHashes
	if len(seq) == 0 {
		seq = kvevent.SequenceHashes(nil, hashes)
	}
	var cands []indexer.Candidate
	for _, id := range slices.Sorted(maps.Keys(f.workers)) {
		w := f.workers[id]
		if w.BlockSize != bs && w.BlockSize > 0 {
			continue // holds no block of the route's hashes, as the node's servesBlockSize
		}
		for _, dp := range dpRanks(w) {
			r := kvevent.Rank{Worker: id, DP: dp}
			c := indexer.Candidate{Rank: r, CapacityBlocks: w.Capacity[kvevent.TierDevice]}
			c.Load, c.PotentialDecodeBlocks = f.load(r, seq)
			if st := f.ranks[r]; st != nil {
				for _, h := range hashes {
					m := st.Held[h]
					if m == 0 {
						break
					}
					for t := range kvevent.Tier(kvevent.NumTiers) {
						if m.Has(t) {
							c.Overlap[t]++
							break
						}
					}
				}
			}
			cands = append(cands, c)
		}
	}
	p := f.settings.Params.With(q.Overrides)
	var rng *rand.Rand
	if p.Temperature > 0 {
		rng = rand.New(rand.NewPCG(1, 2))
	}
	// Every stage takes a microsecond here, so that tests can count them.
	res.Stages = raftfsm.RouteStages{Hash: time.Microsecond, Match: time.Microsecond, Load: time.Microsecond, Score: time.Microsecond}
	err := indexer.Select(p, req, cands, rng, &res.Decision)
	var first *booking
	if q.Book {
		first = f.bookings[q.RequestID]
	}
	if errors.Is(err, indexer.ErrOverloaded) && first != nil && res.Decision.Keep(first.rank) {
		// A retry whose first try made the ranks busy: it is booked, as
		// on the node.
		err = nil
	}
	if err != nil {
		return res, err
	}
	if q.Book {
		switch {
		case first == nil:
			c := res.Decision.Chosen()
			f.bookings[q.RequestID] = &booking{rank: res.Decision.Rank, isl: isl, seq: slices.Clone(seq),
				cached: min(int(c.OverlapBlocks)*bs, isl), prefill: true}
		case !res.Decision.Keep(first.rank):
			// The node's answer to a retry whose rank is no candidate.
			return res, fmt.Errorf("%w: %w, which is not a candidate of this request", raftfsm.ErrInvalid,
				&raftfsm.BookedElsewhereError{ID: q.RequestID, Rank: first.rank})
		}
		// A retry (the same request id) answers the rank its first try
		// booked (Keep), and adds no load, as the node's does.
		res.Booked = true
		res.Stages.Book = time.Microsecond
	}
	if q.Brief {
		res.Decision.Candidates = []indexer.CandidateScore{*res.Decision.Chosen()}
		res.Decision.Index = 0
	}
	return res, nil
}

// IngestEvents implements api.Backend with the per-rank cursor rules:
// an id at or below the cursor is a duplicate, the next one applies, one
// past it is a gap that stops the batch.
func (f *Fake) IngestEvents(ctx context.Context, batches []raftfsm.RankBatch) ([]raftfsm.RankAck, error) {
	if err := f.enter("IngestEvents", true); err != nil {
		return nil, err
	}
	defer f.mu.Unlock()
	acks := make([]raftfsm.RankAck, len(batches))
	for i, b := range batches {
		st := f.rank(b.Rank)
		ack := raftfsm.RankAck{Rank: b.Rank}
		for j := range b.Events {
			e := &b.Events[j]
			if !e.Valid() || e.Rank != b.Rank {
				f.malformed++
				continue
			}
			switch {
			case e.EventID <= st.Cursor:
				ack.Dups++
				continue
			case e.EventID > st.Cursor+1:
				ack.Gap = true
			}
			if ack.Gap {
				break
			}
			st.apply(e)
			st.Cursor = e.EventID
			ack.Applied++
		}
		ack.Cursor = st.Cursor
		acks[i] = ack
	}
	return acks, nil
}

func (f *Fake) rank(r kvevent.Rank) *rankState {
	st := f.ranks[r]
	if st == nil {
		st = &rankState{Held: map[uint64]kvevent.Mask{}, Engine: map[uint64]uint64{}}
		f.ranks[r] = st
	}
	return st
}

func (st *rankState) apply(e *kvevent.Event) {
	switch e.Kind {
	case kvevent.KindStored:
		for _, b := range e.Blocks {
			st.Engine[b.EngineHash] = b.LocalHash
			st.Held[b.LocalHash] |= e.Tier.Bit()
		}
	case kvevent.KindRemoved:
		for _, h := range e.Removed {
			local, ok := st.Engine[h]
			if !ok {
				continue
			}
			st.Held[local] &^= e.Tier.Bit()
			if st.Held[local] == 0 {
				delete(st.Held, local)
				delete(st.Engine, h)
			}
		}
	case kvevent.KindCleared:
		clear(st.Held)
		clear(st.Engine)
	}
}

// ReplaceRank implements api.Backend.
func (f *Fake) ReplaceRank(ctx context.Context, rank kvevent.Rank, cursor uint64, stored []kvevent.Event) error {
	if err := f.enter("ReplaceRank", true); err != nil {
		return err
	}
	defer f.mu.Unlock()
	// Like events, a dump is applied whether or not its worker is
	// registered (as raftfsm does).
	st := &rankState{Cursor: cursor, Held: map[uint64]kvevent.Mask{}, Engine: map[uint64]uint64{}}
	for i := range stored {
		e := &stored[i]
		if !e.Valid() || e.Kind != kvevent.KindStored || e.Rank != rank {
			f.malformed++
			return fmt.Errorf("%w: dump event %d", raftfsm.ErrInvalid, i)
		}
		st.apply(e)
	}
	f.ranks[rank] = st
	return nil
}

// RegisterWorker implements api.Backend.
func (f *Fake) RegisterWorker(ctx context.Context, w raftfsm.WorkerInfo) error {
	if err := f.enter("RegisterWorker", true); err != nil {
		return err
	}
	defer f.mu.Unlock()
	if w.BlockSize <= 0 {
		f.malformed++
		return fmt.Errorf("%w: block size %d", raftfsm.ErrInvalid, w.BlockSize)
	}
	w.DPRanks = slices.Clone(w.DPRanks)
	f.workers[w.ID] = w
	return nil
}

// DeregisterWorker implements api.Backend.
func (f *Fake) DeregisterWorker(ctx context.Context, id uint64) error {
	if err := f.enter("DeregisterWorker", true); err != nil {
		return err
	}
	defer f.mu.Unlock()
	if _, ok := f.workers[id]; !ok {
		return fmt.Errorf("deregister worker %d: %w", id, raftfsm.ErrUnknownWorker)
	}
	delete(f.workers, id)
	for r := range f.ranks {
		if r.Worker == id {
			delete(f.ranks, r)
		}
	}
	// Its bookings are freed, as the node's (Sequences.RemoveWorker): a
	// retry of one books anew (the fake keeps no tombstones).
	maps.DeleteFunc(f.bookings, func(_ string, b *booking) bool { return b.rank.Worker == id })
	return nil
}

// PrefillDone implements api.Backend.
func (f *Fake) PrefillDone(ctx context.Context, id string) error {
	if err := f.enter("PrefillDone", true); err != nil {
		return err
	}
	defer f.mu.Unlock()
	if b := f.bookings[id]; b != nil {
		b.prefill = false
	}
	return nil
}

// Free implements api.Backend.
func (f *Fake) Free(ctx context.Context, id string) error {
	if err := f.enter("Free", true); err != nil {
		return err
	}
	defer f.mu.Unlock()
	delete(f.bookings, id)
	return nil
}

// CheckLeader implements api.Backend: nil on the leader, a
// *raftfsm.NotLeaderError on a follower; a hook's error for "CheckLeader"
// plays a leader not yet caught up (raftfsm.ErrNoLeader).
func (f *Fake) CheckLeader() error {
	if err := f.enter("CheckLeader", true); err != nil {
		return err
	}
	f.mu.Unlock()
	return nil
}

// SetSettings implements api.Backend.
func (f *Fake) SetSettings(ctx context.Context, s raftfsm.Settings) error {
	if err := f.enter("SetSettings", true); err != nil {
		return err
	}
	defer f.mu.Unlock()
	// What a state takes: the server holds new weights to
	// indexer.MaxWeight against the settings its backend answers (a
	// weight over it passes only as the one held now), and a test's
	// backend may answer other settings than the fake's own.
	if s.Params.ValidateStored() != nil {
		f.malformed++
		return fmt.Errorf("%w: settings", raftfsm.ErrInvalid)
	}
	f.settings = s
	return nil
}

// AddMember implements api.Backend.
func (f *Fake) AddMember(ctx context.Context, id, raftAddr, httpAddr string) error {
	if err := f.enter("AddMember", true); err != nil {
		return err
	}
	defer f.mu.Unlock()
	if id == "" || raftAddr == "" || httpAddr == "" {
		f.malformed++
		return fmt.Errorf("%w: member", raftfsm.ErrInvalid)
	}
	for _, m := range f.members {
		if m.ID == id {
			return fmt.Errorf("%w: member %q exists", raftfsm.ErrInvalid, id)
		}
	}
	f.members = append(f.members, raftfsm.Member{ID: id, RaftAddr: raftAddr, HTTPAddr: httpAddr, Voter: true})
	return nil
}

// RemoveMember implements api.Backend.
func (f *Fake) RemoveMember(ctx context.Context, id string) error {
	if err := f.enter("RemoveMember", true); err != nil {
		return err
	}
	defer f.mu.Unlock()
	i := slices.IndexFunc(f.members, func(m raftfsm.Member) bool { return m.ID == id })
	if i < 0 {
		return fmt.Errorf("%w: no member %q", raftfsm.ErrInvalid, id)
	}
	f.members = slices.Delete(f.members, i, i+1)
	return nil
}

// TransferLeadership implements api.Backend: the member table shows the
// new leader; the fake itself stays the leader.
func (f *Fake) TransferLeadership(ctx context.Context, to string) error {
	if err := f.enter("TransferLeadership", true); err != nil {
		return err
	}
	defer f.mu.Unlock()
	if to == "" {
		for _, m := range f.members {
			if m.ID != f.status.ID && m.Voter {
				to = m.ID
				break
			}
		}
		if to == "" {
			return fmt.Errorf("%w: no other voter to transfer to", raftfsm.ErrInvalid)
		}
	}
	i := slices.IndexFunc(f.members, func(m raftfsm.Member) bool { return m.ID == to })
	if i < 0 {
		return fmt.Errorf("%w: no member %q", raftfsm.ErrInvalid, to)
	}
	if !f.members[i].Voter {
		return fmt.Errorf("%w: %s is not a voter (a member still catching up): only a voter can lead", raftfsm.ErrInvalid, to)
	}
	for j := range f.members {
		f.members[j].Leader = j == i
	}
	return nil
}

// The snapshot format of the fake: a magic line, a JSON header line, the
// JSON state, and a trailer line with the SHA-256 of everything before it.
const (
	snapMagic   = "KVFAKESNAP\n"
	snapVersion = 1
)

type snapHeader struct {
	Version uint32           `json:"version"`
	Index   uint64           `json:"index"`
	Term    uint64           `json:"term"`
	Records map[string]int64 `json:"records"`
}

type snapState struct {
	Workers  []raftfsm.WorkerInfo   `json:"workers"`
	Members  []raftfsm.Member       `json:"members"`
	Ranks    map[string]*rankState  `json:"ranks"`
	Settings indexer.Params         `json:"settings"`
	Bookings map[string]snapBooking `json:"bookings"`
}

type snapBooking struct {
	Worker  uint64   `json:"worker"`
	DP      uint32   `json:"dp"`
	ISL     int      `json:"isl"`
	Cached  int      `json:"cached"`
	Seq     []uint64 `json:"seq"`
	Prefill bool     `json:"prefill"`
}

func (f *Fake) encodeSnapshot() ([]byte, raftfsm.SnapshotInfo) {
	st := snapState{Members: f.members, Ranks: map[string]*rankState{}, Settings: f.settings.Params,
		Bookings: map[string]snapBooking{}}
	for _, id := range slices.Sorted(maps.Keys(f.workers)) {
		st.Workers = append(st.Workers, f.workers[id])
	}
	for r, rs := range f.ranks {
		st.Ranks[r.String()] = rs
	}
	for id, b := range f.bookings {
		st.Bookings[id] = snapBooking{Worker: b.rank.Worker, DP: b.rank.DP, ISL: b.isl, Cached: b.cached, Seq: b.seq, Prefill: b.prefill}
	}
	hdr := snapHeader{Version: snapVersion, Index: f.status.AppliedIndex, Term: f.status.Term, Records: map[string]int64{
		"workers": int64(len(st.Workers)), "members": int64(len(st.Members)),
		"ranks": int64(len(st.Ranks)), "bookings": int64(len(st.Bookings)),
	}}
	var buf bytes.Buffer
	buf.WriteString(snapMagic)
	h, _ := json.Marshal(hdr)
	buf.Write(h)
	buf.WriteByte('\n')
	s, _ := json.Marshal(st)
	buf.Write(s)
	buf.WriteByte('\n')
	sum := sha256.Sum256(buf.Bytes())
	fmt.Fprintf(&buf, "sha256 %s\n", hex.EncodeToString(sum[:]))
	return buf.Bytes(), raftfsm.SnapshotInfo{FormatVersion: snapVersion, Index: hdr.Index, Term: hdr.Term,
		Records: hdr.Records, Bytes: int64(buf.Len()), SHA256: hex.EncodeToString(sum[:])}
}

// SaveSnapshot implements api.Backend. It writes in small pieces, like a
// real stream.
func (f *Fake) SaveSnapshot(ctx context.Context, w io.Writer) (raftfsm.SnapshotInfo, error) {
	if err := f.enter("SaveSnapshot", true); err != nil {
		return raftfsm.SnapshotInfo{}, err
	}
	data, info := f.encodeSnapshot()
	failAfter, failErr := f.snapshotFailAfter, f.snapshotFailErr
	f.mu.Unlock()
	for off := 0; off < len(data); off += 64 {
		if failAfter > 0 && off >= failAfter {
			if failErr != nil {
				return raftfsm.SnapshotInfo{}, failErr
			}
			return raftfsm.SnapshotInfo{}, errors.New("snapshot store: disk read failed")
		}
		if err := ctx.Err(); err != nil {
			return raftfsm.SnapshotInfo{}, err
		}
		if _, err := w.Write(data[off:min(off+64, len(data))]); err != nil {
			return raftfsm.SnapshotInfo{}, fmt.Errorf("write snapshot: %w", err)
		}
	}
	return info, nil
}

// RestoreSnapshot implements api.Backend. On a follower it refuses before
// reading anything.
func (f *Fake) RestoreSnapshot(ctx context.Context, r io.Reader) (raftfsm.SnapshotInfo, error) {
	if err := f.enter("RestoreSnapshot", true); err != nil {
		return raftfsm.SnapshotInfo{}, err
	}
	f.mu.Unlock()
	hdr, st, info, err := decodeSnapshot(r)
	if err != nil {
		return info, err
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	f.workers = map[uint64]raftfsm.WorkerInfo{}
	for _, w := range st.Workers {
		f.workers[w.ID] = w
	}
	f.members = st.Members
	f.ranks = map[kvevent.Rank]*rankState{}
	for k, rs := range st.Ranks {
		var r kvevent.Rank
		if _, err := fmt.Sscanf(k, "%d/%d", &r.Worker, &r.DP); err == nil {
			f.ranks[r] = rs
		}
	}
	f.bookings = map[string]*booking{}
	for id, b := range st.Bookings {
		f.bookings[id] = &booking{rank: kvevent.Rank{Worker: b.Worker, DP: b.DP}, isl: b.ISL, cached: b.Cached, seq: b.Seq, prefill: b.Prefill}
	}
	f.settings.Params = st.Settings
	f.status.AppliedIndex = max(f.status.AppliedIndex, hdr.Index)
	f.restores++
	return info, nil
}

// InspectSnapshot reads a snapshot of the fake's format and verifies its
// checksum, like raftfsm.InspectSnapshot does for the node's format.
func InspectSnapshot(r io.Reader) (raftfsm.SnapshotInfo, error) {
	_, _, info, err := decodeSnapshot(r)
	return info, err
}

func decodeSnapshot(r io.Reader) (snapHeader, snapState, raftfsm.SnapshotInfo, error) {
	var hdr snapHeader
	var st snapState
	var info raftfsm.SnapshotInfo
	bad := func(format string, args ...any) error {
		return fmt.Errorf("%w: %s", raftfsm.ErrBadSnapshot, fmt.Sprintf(format, args...))
	}
	data, err := io.ReadAll(r)
	if err != nil {
		return hdr, st, info, fmt.Errorf("read snapshot: %w", err)
	}
	if !bytes.HasPrefix(data, []byte(snapMagic)) {
		return hdr, st, info, bad("not a snapshot (no header)")
	}
	body := bytes.TrimSuffix(data, []byte{'\n'})
	i := bytes.LastIndexByte(body, '\n')
	if i < 0 {
		return hdr, st, info, bad("truncated: no checksum trailer")
	}
	trailer := string(body[i+1:])
	payload := data[:i+1]
	want, ok := strings.CutPrefix(trailer, "sha256 ")
	sum := sha256.Sum256(payload)
	if !ok || want != hex.EncodeToString(sum[:]) {
		return hdr, st, info, bad("checksum mismatch (truncated or corrupted)")
	}
	sc := bufio.NewScanner(bytes.NewReader(payload[len(snapMagic):]))
	sc.Buffer(nil, len(payload))
	if !sc.Scan() || json.Unmarshal(sc.Bytes(), &hdr) != nil {
		return hdr, st, info, bad("bad header")
	}
	if hdr.Version != snapVersion {
		return hdr, st, info, bad("format version %d (want %d)", hdr.Version, snapVersion)
	}
	if !sc.Scan() || json.Unmarshal(sc.Bytes(), &st) != nil {
		return hdr, st, info, bad("bad state")
	}
	return hdr, st, raftfsm.SnapshotInfo{FormatVersion: hdr.Version, Index: hdr.Index, Term: hdr.Term,
		Records: hdr.Records, Bytes: int64(len(data)), SHA256: want}, nil
}
