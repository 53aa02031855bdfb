package compat

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/kvevent"
	"github.com/kvrouter/kvrouter/raftfsm"
	"github.com/kvrouter/kvrouter/sim/enginepub"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/vmihailenco/msgpack/v5"
)

// syncTarget is an AgentlessTarget that commits everything and records
// it, for a subscriber that runs (a goroutine of its own).
type syncTarget struct {
	mu        sync.Mutex
	committed []string // kind:first engine hash; the events are the decoder's, reused
}

func (f *syncTarget) CheckLeader() error                         { return nil }
func (f *syncTarget) WorkerTable() map[uint64]raftfsm.WorkerInfo { return nil }
func (f *syncTarget) Cursor(kvevent.Rank) uint64                 { return 0 }
func (f *syncTarget) IngestEvents(_ context.Context, bs []raftfsm.RankBatch) ([]raftfsm.RankAck, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	for _, ev := range bs[0].Events {
		switch ev.Kind {
		case kvevent.KindStored:
			f.committed = append(f.committed, fmt.Sprintf("store:%#x", ev.Blocks[0].EngineHash))
		case kvevent.KindRemoved:
			f.committed = append(f.committed, fmt.Sprintf("remove:%#x", ev.Removed[0]))
		default:
			f.committed = append(f.committed, ev.Kind.String())
		}
	}
	last := bs[0].Events[len(bs[0].Events)-1].EventID
	return []raftfsm.RankAck{{Rank: bs[0].Rank, Cursor: last, Applied: len(bs[0].Events)}}, nil
}

// summary is what was committed, as kind:engine hash strings.
func (f *syncTarget) summary() []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return slices.Clone(f.committed)
}

// TestAgentlessHybridRemovesFollowTheirGroupsKind: the leader's subscriber
// of an agentless instance (as Agentless starts it) follows a hybrid model
// whose sliding-window layers are group 0 and whose full-attention layers
// are group 1, over real libzmq: group 0's remove (a BlockRemoved has a
// group_idx and no kv_cache_spec_kind) is left out, group 1's commits.
// From a review: its decoder took group 0 for the main group of every
// event without a kind, as wire.md says, and did the opposite. With
// AgentlessConfig.NoLearnGroupKinds it does that still.
func TestAgentlessHybridRemovesFollowTheirGroupsKind(t *testing.T) {
	store := func(h uint64, first uint32, g int, kind string) map[string]any {
		return map[string]any{"type": "BlockStored", "block_hashes": []uint64{h}, "block_size": testBlockSize,
			"token_ids": slices.Repeat([]uint32{first}, testBlockSize), "group_idx": g, "kv_cache_spec_kind": kind}
	}
	remove := func(h uint64, g int) map[string]any {
		return map[string]any{"type": "BlockRemoved", "block_hashes": []uint64{h}, "group_idx": g}
	}
	batches := [][]map[string]any{
		{store(0x11, 1, 0, "sliding_window"), store(0x11, 1, 1, "full_attention")},
		{remove(0x11, 0), store(0x21, 2, 1, "full_attention")},
		{remove(0x11, 1), store(0x22, 3, 1, "full_attention")},
	}
	for _, tc := range []struct {
		noLearn bool
		want    []string
	}{
		{false, []string{"store:0x11", "store:0x21", "remove:0x11", "store:0x22"}},
		{true, []string{"store:0x11", "remove:0x11", "store:0x21", "store:0x22"}},
	} {
		t.Run(fmt.Sprintf("NoLearnGroupKinds=%v", tc.noLearn), func(t *testing.T) {
			pub, err := enginepub.New(enginepub.Config{Endpoint: "tcp://127.0.0.1:*", Buffer: -1, Linger: time.Millisecond})
			if err != nil {
				t.Fatal(err)
			}
			defer pub.Close()
			ft := &syncTarget{}
			a := &Agentless{b: ft, cfg: AgentlessConfig{CommitTimeout: time.Second, Registerer: prometheus.NewRegistry(),
				NoLearnGroupKinds: tc.noLearn}, log: quiet, subs: map[kvevent.Rank]*agentlessSub{}}
			defer a.reconcile(nil, 0)
			a.reconcile(map[uint64]raftfsm.WorkerInfo{9: {ID: 9, Positional: true, BlockSize: testBlockSize,
				EventEndpoints: map[uint32]string{0: pub.Endpoint()}}}, 1)
			ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
			defer cancel()
			if err := pub.WaitSubscribed(ctx, 1); err != nil {
				t.Fatal(err)
			}
			for _, evs := range batches {
				payload, err := msgpack.Marshal([]any{1.5, evs})
				if err != nil {
					t.Fatal(err)
				}
				if _, err := pub.Publish(payload); err != nil {
					t.Fatal(err)
				}
			}
			// The last batch's store tells when every batch is committed.
			waitFor(t, 15*time.Second, "the last batch committed", func() bool {
				return slices.Contains(ft.summary(), "store:0x22")
			})
			if got := ft.summary(); !slices.Equal(got, tc.want) {
				t.Fatalf("committed %v, want %v", got, tc.want)
			}
		})
	}
}
