package enginesub

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
)

// RankEndpoint returns the endpoint of data-parallel rank dp of an engine
// whose rank 0 uses endpoint: each rank publishes on its own port, base + dp
// (wire.md), and serves replay likewise. Only tcp endpoints can be offset.
func RankEndpoint(endpoint string, dp uint32) (string, error) {
	if dp == 0 {
		return endpoint, nil
	}
	i := strings.LastIndexByte(endpoint, ':')
	if !strings.HasPrefix(endpoint, "tcp://") || i < len("tcp://") {
		return "", fmt.Errorf("%w: cannot offset %q by rank %d: not tcp://host:port", ErrConfig, endpoint, dp)
	}
	port, err := strconv.ParseUint(endpoint[i+1:], 10, 16)
	if err != nil || port == 0 || port+uint64(dp) > 65535 {
		return "", fmt.Errorf("%w: cannot offset the port of %q by rank %d", ErrConfig, endpoint, dp)
	}
	return endpoint[:i+1] + strconv.FormatUint(port+uint64(dp), 10), nil
}

// A Group runs one Subscriber per data-parallel rank of one worker.
type Group struct {
	subs []*Subscriber
}

// NewGroup returns the subscribers of ranks cfg.Rank.DP to
// cfg.Rank.DP+ranks-1 of worker cfg.Rank.Worker. cfg.Endpoint and
// cfg.ReplayEndpoint are rank 0's; rank r's are offset by r (RankEndpoint).
// The subscribers share cfg's Sink, Logger and Registerer.
func NewGroup(cfg Config, ranks int) (*Group, error) {
	if ranks <= 0 || uint64(cfg.Rank.DP)+uint64(ranks) > 1<<32 {
		return nil, fmt.Errorf("%w: %d ranks from %d", ErrConfig, ranks, cfg.Rank.DP)
	}
	g := &Group{}
	if cfg.SkipLog == nil {
		cfg.SkipLog = new(SkipLog) // one worker's ranks: each reason logged once
	}
	for i := range ranks {
		c := cfg
		c.Rank.DP = cfg.Rank.DP + uint32(i)
		var err error
		if c.Endpoint, err = RankEndpoint(cfg.Endpoint, c.Rank.DP); err != nil {
			return nil, err
		}
		if cfg.ReplayEndpoint != "" {
			if c.ReplayEndpoint, err = RankEndpoint(cfg.ReplayEndpoint, c.Rank.DP); err != nil {
				return nil, err
			}
		}
		s, err := New(c)
		if err != nil {
			return nil, fmt.Errorf("rank %v: %w", c.Rank, err)
		}
		g.subs = append(g.subs, s)
	}
	return g, nil
}

// Subscribers returns the group's subscribers, by rank.
func (g *Group) Subscribers() []*Subscriber { return g.subs }

// Run runs every subscriber until ctx is cancelled or one of them fails;
// then it stops the others and returns their errors joined (nil after a
// cancellation).
func (g *Group) Run(ctx context.Context) error {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	errs := make([]error, len(g.subs))
	var wg sync.WaitGroup
	for i, s := range g.subs {
		wg.Go(func() {
			if err := s.Run(ctx); err != nil {
				errs[i] = fmt.Errorf("rank %v: %w", s.Rank(), err)
				cancel()
			}
		})
	}
	wg.Wait()
	return errors.Join(errs...)
}
