package testlog

import (
	"fmt"
	"slices"
	"sync"
	"testing"
)

func TestBufferTakesConcurrentWritesWhole(t *testing.T) {
	var b Buffer
	var wg sync.WaitGroup
	for g := range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range 100 {
				fmt.Fprintf(&b, "writer=%d line=%d\n", g, i)
			}
		}()
	}
	wg.Wait()
	if n := len(b.Lines("writer=")); n != 400 {
		t.Fatalf("%d whole lines, want 400", n)
	}
	if got := b.Lines("writer=2 ", "line=77"); !slices.Equal(got, []string{"writer=2 line=77"}) {
		t.Fatalf("Lines(writer=2, line=77) = %q", got)
	}
	if got := b.Lines("nothing"); got != nil {
		t.Fatalf("Lines(nothing) = %q, want none", got)
	}
}
