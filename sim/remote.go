package sim

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"time"

	"github.com/kvrouter/kvrouter/api"
	"github.com/kvrouter/kvrouter/api/client"
	"github.com/kvrouter/kvrouter/kvevent"
	"github.com/kvrouter/kvrouter/raftfsm"
)

// Remote is the live policy: it routes through a running kvrouter
// cluster's HTTP API, and the simulated workers' events reach that
// cluster's index through its event ingestion. Each request is booked on
// the chosen rank, marked prefill-done and freed through the API, so the
// cluster's load view follows the replay.
type Remote struct {
	Client    *client.Client
	Workers   int
	BlockSize int
	// CapacityBlocks is registered as each worker's device capacity.
	CapacityBlocks int64
	Timeout        time.Duration // per call, default 10s

	prefix  string
	pending []raftfsm.RankBatch // events not yet sent, per rank in first-seen order
	Calls   int
}

// Setup (re)registers the simulated workers, dropping whatever the cluster
// held of them from an earlier run, so their event ids start again at 1.
func (p *Remote) Setup(ctx context.Context) error {
	if p.Timeout <= 0 {
		p.Timeout = 10 * time.Second
	}
	p.prefix = "kvsim-" + strconv.FormatInt(time.Now().UnixNano(), 36) + "-"
	for i := 0; i < p.Workers; i++ {
		id := RankOf(i).Worker
		if err := p.Client.DeregisterWorker(ctx, id); err != nil && !isNotFound(err) {
			return fmt.Errorf("deregister worker %d: %w", id, err)
		}
		w := raftfsm.WorkerInfo{ID: id, BlockSize: p.BlockSize, Capacity: [kvevent.NumTiers]int64{p.CapacityBlocks}}
		if err := p.Client.RegisterWorker(ctx, w); err != nil {
			return fmt.Errorf("register worker %d: %w", id, err)
		}
	}
	return nil
}

func isNotFound(err error) bool {
	var ce *client.Error
	return errors.As(err, &ce) && ce.StatusCode == 404
}

func (p *Remote) Name() string { return "router_live" }

func (p *Remote) ctx() (context.Context, context.CancelFunc) {
	return context.WithTimeout(context.Background(), p.Timeout)
}

// flush sends the buffered events, so the index has them before the next
// decision, as an engine's events would have arrived by then.
func (p *Remote) flush() error {
	if len(p.pending) == 0 {
		return nil
	}
	ctx, cancel := p.ctx()
	defer cancel()
	acks, err := p.Client.IngestEvents(ctx, p.pending)
	p.Calls++
	if err != nil {
		return fmt.Errorf("ingest events: %w", err)
	}
	for _, a := range acks {
		if a.Gap {
			return fmt.Errorf("ingest events: gap at rank %v (cursor %d)", a.Rank, a.Cursor)
		}
	}
	p.pending = p.pending[:0]
	return nil
}

func (p *Remote) Route(q *RouteQuery, _ int64) (int, int, error) {
	if err := p.flush(); err != nil {
		return 0, 0, err
	}
	ctx, cancel := p.ctx()
	defer cancel()
	res, err := p.Client.Route(ctx, api.RouteRequest{BlockHashes: q.Local, ISL: q.ISL, Book: true, RequestID: p.prefix + q.ID})
	p.Calls++
	if err != nil {
		return 0, 0, err
	}
	for _, c := range res.Candidates {
		if c.WorkerID == res.WorkerID && c.DPRank == res.DPRank {
			o := c.Overlap
			return int(res.WorkerID) - 1, int(o.Device+o.Host+o.Disk+o.External) * res.BlockSize, nil
		}
	}
	return int(res.WorkerID) - 1, 0, nil
}

func (p *Remote) Observe(ev *kvevent.Event, _ int64) {
	c := *ev
	c.Blocks = slices.Clone(ev.Blocks)
	c.Removed = slices.Clone(ev.Removed)
	for i := range p.pending {
		if p.pending[i].Rank == ev.Rank {
			p.pending[i].Events = append(p.pending[i].Events, c)
			return
		}
	}
	p.pending = append(p.pending, raftfsm.RankBatch{Rank: ev.Rank, Events: []kvevent.Event{c}})
}

func (p *Remote) Started(*RouteQuery, int, int, int64) {}

func (p *Remote) PrefillDone(id string, _ int64) {
	ctx, cancel := p.ctx()
	defer cancel()
	_ = p.Client.PrefillDone(ctx, p.prefix+id)
	p.Calls++
}

func (p *Remote) Finished(id string, _ int64) {
	ctx, cancel := p.ctx()
	defer cancel()
	_ = p.Client.Free(ctx, p.prefix+id)
	p.Calls++
}
