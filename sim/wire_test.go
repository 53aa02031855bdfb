package sim

import (
	"bytes"
	"encoding/hex"
	"errors"
	"fmt"
	"slices"
	"strings"
	"testing"

	"github.com/kvrouter/kvrouter/kvevent"
	"github.com/kvrouter/kvrouter/kvevent/engine"
)

// wire.md's golden BlockRemoved, array form.
func TestAppendWireEventGoldenRemoved(t *testing.T) {
	want, _ := hex.DecodeString("93ac426c6f636b52656d6f76656491cfdab89baa7b5857c0a3475055")
	got := AppendWireEvent(nil, &WireEvent{Kind: kvevent.KindRemoved, Hashes: []uint64{0xdab89baa7b5857c0}})
	if !bytes.Equal(got, want) {
		t.Fatalf("got  % x\nwant % x", got, want)
	}
}

// AppendBatch's payloads decode, with the repository's decoder, into the
// events they were made of; the content hashes come from the tokens.
func TestAppendBatchDecodes(t *testing.T) {
	const bs = 4
	toks := make([]uint32, 3*bs)
	for i := range toks {
		toks[i] = uint32(i*7919) % 131072
	}
	local := kvevent.LocalHashes(nil, toks, bs, kvevent.SeedFor("", ""))
	evs := []WireEvent{
		{Kind: kvevent.KindStored, Hashes: []uint64{10, 1 << 63}, Tokens: toks[:2*bs], BlockSize: bs},
		{Kind: kvevent.KindStored, Hashes: []uint64{7}, Parent: 1 << 63, HasParent: true, Tokens: toks[2*bs:], BlockSize: bs},
		{Kind: kvevent.KindRemoved, Hashes: []uint64{7, 1 << 63}},
		{Kind: kvevent.KindCleared},
	}
	payload := AppendBatch(nil, 1700000000.5, evs, 0)
	rank := kvevent.Rank{Worker: 3}
	d, err := engine.NewDecoder(engine.Config{Rank: rank, BlockSize: bs})
	if err != nil {
		t.Fatal(err)
	}
	var b engine.Batch
	if err := d.Decode(payload, &b); err != nil {
		t.Fatal(err)
	}
	want := []kvevent.Event{
		{Rank: rank, Kind: kvevent.KindStored, Tier: kvevent.TierDevice, Blocks: []kvevent.Block{{EngineHash: 10, LocalHash: local[0]}, {EngineHash: 1 << 63, LocalHash: local[1]}}},
		{Rank: rank, Kind: kvevent.KindStored, Tier: kvevent.TierDevice, HasParent: true, Parent: 1 << 63, Blocks: []kvevent.Block{{EngineHash: 7, LocalHash: local[2]}}},
		{Rank: rank, Kind: kvevent.KindRemoved, Tier: kvevent.TierDevice, Removed: []uint64{7, 1 << 63}},
		{Rank: rank, Kind: kvevent.KindCleared},
	}
	if b.TS != 1700000000.5 || !b.HasDPRank || b.DPRank != 0 {
		t.Fatalf("ts %v, dp %v/%v", b.TS, b.DPRank, b.HasDPRank)
	}
	if got, want := fmtWire(b.Events), fmtWire(want); got != want {
		t.Fatalf("decoded\n%s\nwant\n%s", got, want)
	}
	if s := d.Stats(); s.Emitted != 4 || s.Events != 4 {
		t.Fatalf("decoder stats %+v", s)
	}
}

// fmtWire prints events without their ids, for comparisons.
func fmtWire(evs []kvevent.Event) string {
	var b bytes.Buffer
	for _, e := range evs {
		fmt.Fprintf(&b, "%v %v tier=%v parent=%v/%#x blocks=%v removed=%#x\n", e.Rank, e.Kind, e.Tier, e.HasParent, e.Parent, e.Blocks, e.Removed)
	}
	return b.String()
}

type recPub struct {
	payloads [][]byte
	fail     error
}

func (p *recPub) Publish(b []byte) (uint64, error) {
	if p.fail != nil {
		return 0, p.fail
	}
	p.payloads = append(p.payloads, slices.Clone(b))
	return uint64(len(p.payloads) - 1), nil
}

// A store that is not the current request's blocks cannot be given its
// tokens: the fleet says so at the next flush instead of sending a wrong
// event.
func TestWireFleetRefusesBlocksOfAnotherRequest(t *testing.T) {
	reqs := GenerateSharedPrefix(SharedPrefixConfig{Requests: 2, Sessions: 2, Seed: 1})
	pr := prepare(t, reqs, 16)
	f := &WireFleet{BlockSize: 16, Pubs: []BatchPublisher{&recPub{}}}
	f.Query(&RouteQuery{ID: "0", Local: pr.Local[0], Seq: pr.Seq[0], Req: &pr.Reqs[0]})
	n := len(pr.Seq[1]) - 1
	f.Observe(&kvevent.Event{Rank: RankOf(0), Kind: kvevent.KindStored, HasParent: true, Parent: pr.Seq[1][n-1],
		Blocks: []kvevent.Block{{EngineHash: pr.Seq[1][n], LocalHash: pr.Local[1][n]}}})
	if err := f.Flush(); !errors.Is(err, ErrWire) {
		t.Fatalf("flush: %v, want ErrWire", err)
	}
	// An error stays (see TestReplayStopsOnAWireError): a fresh fleet each.
	f = &WireFleet{BlockSize: 16, Pubs: []BatchPublisher{&recPub{}}}
	f.Observe(&kvevent.Event{Rank: RankOf(1), Kind: kvevent.KindCleared})
	if err := f.Flush(); !errors.Is(err, ErrWire) || !strings.Contains(err.Error(), "1 workers") {
		t.Fatalf("event of worker 2 of 1: %v, want ErrWire", err)
	}
	f = &WireFleet{BlockSize: 16, Pubs: []BatchPublisher{&recPub{fail: errors.New("socket gone")}}}
	f.Observe(&kvevent.Event{Rank: RankOf(0), Kind: kvevent.KindCleared})
	if err := f.Flush(); !errors.Is(err, ErrWire) || !strings.Contains(err.Error(), "socket gone") {
		t.Fatalf("publisher error: %v, want ErrWire", err)
	}
}

// flakyPub fails every publish from the failAt-th on (1-based; 0: none).
type flakyPub struct {
	recPub
	n, failAt int
}

func (p *flakyPub) Publish(b []byte) (uint64, error) {
	p.n++
	if p.failAt > 0 && p.n >= p.failAt {
		return 0, errors.New("socket gone")
	}
	return p.recPub.Publish(b)
}

// A batch a worker's publisher could not send stops the live replay with
// the wire error: the batch stays pending, every later Flush returns the
// error, the requests in flight are freed on the cluster and no request
// is counted as rejected for it. (The batch was dropped before it was
// sent, with no gap for the agent to heal from; the error came back on the
// next route, counted as a rejection of an innocent request, and the
// replay went on, the fleet dropping every worker's events meanwhile.)
func TestReplayStopsOnAWireError(t *testing.T) {
	f, cl := fakeCluster(t)
	p := setUpRemote(t, cl)
	bad := &flakyPub{failAt: 3}
	fleet := &WireFleet{BlockSize: 16, Pubs: []BatchPublisher{&recPub{}, bad}}
	pr := prepare(t, GenerateSharedPrefix(SharedPrefixConfig{Requests: 40, Sessions: 4, Seed: 1}), 16)
	res, err := Replay(pr, Config{Workers: 2, BlockSize: 16}, WithWire(p, fleet))
	if !errors.Is(err, ErrWire) || !strings.Contains(err.Error(), "worker 2: socket gone") {
		t.Fatalf("replay: %v, want the wire error of worker 2", err)
	}
	if res.Rejected != 0 || res.Errors != 0 || res.Requests == 0 || res.Requests >= len(pr.Reqs) || res.Offered != res.Requests {
		t.Fatalf("stopped after %d served of %d offered, %d rejected, %d errors: want no request blamed for the wire",
			res.Requests, res.Offered, res.Rejected, res.Errors)
	}
	if b := f.Bookings(); len(b) != 0 {
		t.Fatalf("bookings left on the cluster: %v", b)
	}
	if len(bad.payloads) != 2 || len(fleet.pending[1]) == 0 {
		t.Fatalf("worker 2: %d batches sent, %d events pending; want 2 sent, the failed batch kept", len(bad.payloads), len(fleet.pending[1]))
	}
	if err := fleet.Flush(); !errors.Is(err, ErrWire) {
		t.Fatalf("flush after the failure: %v, want the wire error again", err)
	}
}

// A replay stopped by a wire error still reports the lifecycle failures of
// the requests it freed while stopping, and before: Result.Unfreed and
// Errors, as a replay that ran to its end does (kvsim says from Unfreed
// that bookings may remain, exactly when they are likely stranded).
func TestReplayStoppedByAWireErrorKeepsItsLifecycleFailures(t *testing.T) {
	f, cl := fakeCluster(t)
	p := setUpRemote(t, cl)
	f.SetHook(func(m string) error {
		if m == "Free" {
			return errors.New("leader lost")
		}
		return nil
	})
	fleet := &WireFleet{BlockSize: 16, Pubs: []BatchPublisher{&recPub{}, &flakyPub{failAt: 3}}}
	pr := prepare(t, GenerateSharedPrefix(SharedPrefixConfig{Requests: 40, Sessions: 4, Seed: 1}), 16)
	res, err := Replay(pr, Config{Workers: 2, BlockSize: 16}, WithWire(p, fleet))
	if !errors.Is(err, ErrWire) {
		t.Fatalf("replay: %v, want ErrWire", err)
	}
	left := len(f.Bookings())
	lf := p.LifecycleFailures()
	if left == 0 || lf.Unfreed != left {
		t.Fatalf("setup: %d bookings left, the policy counts %d unfreed", left, lf.Unfreed)
	}
	if res.Unfreed != left || res.Errors != lf.Failed || res.FirstError == "" || res.HitRate == 0 {
		t.Fatalf("%d bookings left on the cluster (policy: %d unfreed, %d failed); the result says %d unfreed, %d errors (first %q), hit rate %v",
			left, lf.Unfreed, lf.Failed, res.Unfreed, res.Errors, res.FirstError, res.HitRate)
	}
}
