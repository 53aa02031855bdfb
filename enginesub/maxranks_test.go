package enginesub

import (
	"context"
	"errors"
	"os"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/internal/limits"
	"github.com/kvrouter/kvrouter/kvevent"
	"github.com/kvrouter/kvrouter/kvevent/engine"
)

// TestAGroupOfTheMaximumRanksOpensEverySocket: kvagent takes --dp-size up
// to limits.MaxDPRanks (4096), and the router's agentless mode runs one
// subscriber per registered dp rank (up to 4096 per instance), each with
// its own SUB socket. libzmq's default context allows ZMQ_MAX_SOCKETS
// (1023 by default) sockets in all: every rank past the 1023rd failed to
// open its socket ("too many open files") until the subscribers' context
// raised it (MaxSockets). 1100 ranks, past the default, show it in a few
// seconds; all 4096 under KVROUTER_LONG (make test-long), some 15 s.
func TestAGroupOfTheMaximumRanksOpensEverySocket(t *testing.T) {
	ranks := 1100
	if os.Getenv("KVROUTER_LONG") != "" {
		ranks = limits.MaxDPRanks
	}
	if err := OpenFiles(ranks); err != nil {
		t.Skip(err)
	}
	g, err := NewGroup(Config{Endpoint: "tcp://127.0.0.1:20000", Sink: &recSink{}, Logger: quiet,
		Rank: kvevent.Rank{Worker: 1}, Decoder: engine.Config{BlockSize: 4}}, ranks)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	var mu sync.Mutex
	var failed int
	var first error
	for _, s := range g.subs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := s.Run(ctx); err != nil {
				mu.Lock()
				failed++
				if first == nil {
					first = err
				}
				mu.Unlock()
			}
		}()
	}
	ready := 0
	deadline := time.After(30 * time.Second)
	for _, s := range g.subs {
		select {
		case <-s.Ready():
			ready++
			continue
		case <-deadline:
		}
		break
	}
	cancel()
	wg.Wait()
	if failed > 0 || ready != len(g.subs) {
		t.Fatalf("%d of %d ranks' subscribers failed to open (first: %v); %d ready", failed, len(g.subs), first, ready)
	}
}

// TestARefusedSocketNamesTheLimitItMet: libzmq answers EMFILE both when
// its socket limit is reached and when the process's open files are, and
// says only "too many open files"; the error names which.
func TestARefusedSocketNamesTheLimitItMet(t *testing.T) {
	emfile := error(syscall.EMFILE)
	if got := limitError(emfile, MaxSockets).Error(); !strings.Contains(got, "libzmq socket limit of 65535") {
		t.Errorf("at the socket limit: %q, want it named", got)
	}
	if got := limitError(emfile, 10).Error(); !strings.Contains(got, "open files limit") {
		t.Errorf("below the socket limit: %q, want the open files limit named", got)
	}
	if err := OpenFiles(1 << 40); !errors.Is(err, ErrOpenFiles) {
		t.Errorf("OpenFiles(2^40) = %v, want ErrOpenFiles", err)
	}
	if err := OpenFiles(1); err != nil {
		t.Errorf("OpenFiles(1) = %v, want nil", err)
	}
}
