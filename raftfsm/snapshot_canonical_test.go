package raftfsm

import (
	"bytes"
	"encoding/binary"
	"errors"
	"math"
	"testing"

	"github.com/kvrouter/kvrouter/indexer"
	"github.com/kvrouter/kvrouter/kvevent"
	"github.com/kvrouter/kvrouter/store"
)

// Records of hand-built streams, as the state database lays them out
// (store/state.go).

func workerRec(key uint64, w WorkerInfo) rec {
	var e enc
	encodeWorker(&e, &w)
	return rec{append([]byte{store.KindWorker}, u64key(key)...), e.b}
}

func nodeRec(seq, parent, local uint64, root bool) rec {
	v := binary.BigEndian.AppendUint64(nil, parent)
	v = binary.BigEndian.AppendUint64(v, local)
	flags := byte(0)
	if root {
		flags = 1
	}
	return rec{binary.BigEndian.AppendUint64([]byte{store.KindNode}, seq), append(v, flags)}
}

func entryRec(worker uint64, dp uint32, eh, seq uint64) rec {
	k := binary.BigEndian.AppendUint64([]byte{store.KindEntry}, worker)
	k = binary.BigEndian.AppendUint32(k, dp)
	k = binary.BigEndian.AppendUint64(k, eh)
	v := binary.BigEndian.AppendUint64(nil, seq)
	v = append(v, 1) // tier 0
	return rec{k, binary.BigEndian.AppendUint32(v, 0)}
}

// streamOfRecs lays out a current-format stream of recs (in key order),
// with the counts they make.
func streamOfRecs(recs []rec) []byte {
	counts := map[byte]uint64{}
	for _, r := range recs {
		counts[r.k[0]]++
	}
	return buildStream(snapshotVersion, recs, map[byte]uint64{}, counts)
}

// TestCheckRefusesRecordsTheStateWouldNotWrite: the check before a user
// restore or a seed refuses a stream whose records decode and load, but
// not one record per item of the state they load into. From a review: a
// rank holding one node under two engine hashes (two residency records)
// passed; the index kept one residency, the state database both, and once
// the worker was deregistered the other record pointed at a freed node,
// so that no node of the cluster started again. A node record the index
// merges or drops is the same: nothing would ever delete it.
func TestCheckRefusesRecordsTheStateWouldNotWrite(t *testing.T) {
	w1 := workerRec(1, WorkerInfo{ID: 1, BlockSize: 16, DPRanks: []uint32{0, 1}})
	for _, tc := range []struct {
		name string
		recs []rec
	}{
		{"a rank holds a node under two engine hashes",
			[]rec{w1, nodeRec(100, 0, 100, true), entryRec(1, 0, 10, 100), entryRec(1, 0, 11, 100)}},
		{"two node records at one position",
			[]rec{w1, nodeRec(100, 0, 1000, true), nodeRec(101, 0, 1000, true), entryRec(1, 0, 10, 100), entryRec(1, 1, 10, 101)}},
		{"a node record no rank holds",
			[]rec{w1, nodeRec(100, 0, 100, true), nodeRec(200, 0, 200, true), entryRec(1, 0, 10, 100)}},
		{"a node record whose parent is missing",
			[]rec{w1, nodeRec(100, 0, 100, true), nodeRec(kvevent.SequenceHash(999, 2000), 999, 2000, false), entryRec(1, 0, 10, 100)}},
		// From a second review: a root child of content hash 1000 under
		// the name 999 loaded as node 999, and the restored cluster then
		// refused, as a name collision, a root block of content hash 999
		// that a state built from events takes.
		{"a node record under another name than its position's",
			[]rec{w1, nodeRec(999, 0, 1000, true), entryRec(1, 0, 10, 999)}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := checkSnapshot(bytes.NewReader(streamOfRecs(tc.recs)), indexer.New(indexer.Config{}))
			if !errors.Is(err, ErrBadSnapshot) {
				t.Fatalf("check: %v, want ErrBadSnapshot", err)
			}
		})
	}
	// The same state with one record per item passes.
	child := kvevent.SequenceHash(100, 2000)
	ok := []rec{w1, nodeRec(100, 0, 100, true), nodeRec(child, 100, 2000, false), entryRec(1, 0, 10, 100), entryRec(1, 1, 10, child)}
	if _, err := checkSnapshot(bytes.NewReader(streamOfRecs(ok)), indexer.New(indexer.Config{})); err != nil {
		t.Fatalf("check of a stream with one record per item: %v", err)
	}
}

// TestCheckRefusesARecordUnderAnotherKey: the check refuses a worker,
// settings or load meta record under a key other than the one the state
// writes it at. From a review: a worker record under another worker's key
// (the id is read from the value) and settings under a key other than 's'
// passed and restored; the deregister, or the settings applied after,
// changed the record at the right key, and the restored one came back at
// the next start, on the nodes that restarted only.
func TestCheckRefusesARecordUnderAnotherKey(t *testing.T) {
	settings := func(key byte) rec {
		var e enc
		encodeSettingsValue(&e, &Settings{Params: indexer.DefaultParams(), View: indexer.ViewTiered})
		return rec{[]byte{store.KindSettings, key}, e.b}
	}
	loadMeta := func(key byte) rec {
		var e enc
		e.sv(5)
		return rec{[]byte{store.KindLoadMeta, key}, e.b}
	}
	for _, tc := range []struct {
		name string
		recs []rec
	}{
		{"worker 7 under worker 1's key", []rec{workerRec(1, WorkerInfo{ID: 7, BlockSize: 16})}},
		{"settings under 'x'", []rec{settings('x')}},
		{"the sweep clock and an earlier build's horizon", []rec{loadMeta(loadMetaClock), loadMeta(loadMetaHorizon)}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := checkSnapshot(bytes.NewReader(streamOfRecs(tc.recs)), indexer.New(indexer.Config{}))
			if !errors.Is(err, ErrBadSnapshot) {
				t.Fatalf("check: %v, want ErrBadSnapshot", err)
			}
		})
	}
	// Each under its own key passes; so does an earlier build's horizon
	// alone (format 3).
	for _, recs := range [][]rec{
		{workerRec(7, WorkerInfo{ID: 7, BlockSize: 16}), loadMeta(loadMetaClock), settings('s')},
		{loadMeta(loadMetaHorizon)},
	} {
		if _, err := checkSnapshot(bytes.NewReader(streamOfRecs(recs)), indexer.New(indexer.Config{})); err != nil {
			t.Fatalf("check of records under their keys: %v", err)
		}
	}
}

// TestCheckRefusesSettingsNoBuildWrites pins that the check before a user
// restore or a seed refuses a settings record whose weights no build
// could have stored (NaN, infinite or negative: every SetSettings since
// the first refused them), as docs/operations.md says of "a file whose
// records the cluster would not write itself". Restored, such settings
// fail every route of the cluster (Select refuses them: each route is
// answered 400 invalid, the client's fault) until new settings are put.
// Weights over indexer.MaxWeight pass: an older build stored them.
func TestCheckRefusesSettingsNoBuildWrites(t *testing.T) {
	settings := func(p indexer.Params) rec {
		var e enc
		encodeSettingsValue(&e, &Settings{Params: p, View: indexer.ViewDedup})
		return rec{[]byte{store.KindSettings, 's'}, e.b}
	}
	for _, tc := range []struct {
		name string
		set  func(*indexer.Params)
	}{
		{"NaN temperature", func(p *indexer.Params) { p.Temperature = math.NaN() }},
		{"infinite prefill load scale", func(p *indexer.Params) { p.PrefillLoadScale = math.Inf(1) }},
		{"negative overlap credit", func(p *indexer.Params) { p.OverlapScoreCredit = -1 }},
		{"negative busy prefill tokens", func(p *indexer.Params) { p.BusyPrefillTokens = -5 }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := indexer.DefaultParams()
			tc.set(&p)
			_, err := checkSnapshot(bytes.NewReader(streamOfRecs([]rec{settings(p)})), indexer.New(indexer.Config{}))
			if !errors.Is(err, ErrBadSnapshot) {
				t.Fatalf("check of settings %+v: %v, want ErrBadSnapshot", p, err)
			}
		})
	}
	p := indexer.DefaultParams()
	p.PrefillLoadScale = 1e15 // over MaxWeight: an older build took it
	if _, err := checkSnapshot(bytes.NewReader(streamOfRecs([]rec{settings(p)})), indexer.New(indexer.Config{})); err != nil {
		t.Fatalf("check of settings an older build stored (prefill_load_scale 1e15): %v", err)
	}
}
