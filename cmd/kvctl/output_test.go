package main

import (
	"bytes"
	"strings"
	"testing"

	"github.com/kvrouter/kvrouter/api"
)

// TestSizeRoundsIntoTheNextUnit: a byte count just under a unit prints as
// 1.0 of that unit, not as 1024.0 of the unit below (snapshot save and
// restore lines, inspect's size, index stats).
func TestSizeRoundsIntoTheNextUnit(t *testing.T) {
	for n, want := range map[int64]string{
		1023: "1023 B", 1024: "1.0 KiB", 1<<20 - 1: "1.0 MiB", 1<<20 - 52: "1023.9 KiB",
		1<<30 - 1: "1.0 GiB", 3 << 20: "3.0 MiB", 1<<62 + 1<<61: "6.0 EiB",
	} {
		if got := size(n); got != want {
			t.Errorf("size(%d) = %q, want %q", n, got, want)
		}
	}
}

// TestCellQuotesAllButPrintableText: a table cell is left as it is when it
// is printable text, and quoted when a control character or invalid UTF-8
// in it could break the table's rows or columns.
func TestCellQuotesAllButPrintableText(t *testing.T) {
	for in, want := range map[string]string{
		"llama 3.1-8B": "llama 3.1-8B", "modèle": "modèle", "-": "-", "": "",
		"a\nb": `"a\nb"`, "a\tb": `"a\tb"`, "a\rb": `"a\rb"`, "\x1b[2J": `"\x1b[2J"`, "a\xffb": `"a\xffb"`,
	} {
		if got := cell(in); got != want {
			t.Errorf("cell(%q) = %s, want %s", in, got, want)
		}
	}
}

// TestIndexStatsRowsShowTheirOwnFigures: each row of kvctl index stats
// shows its own figure. The test cluster's fake answers zeros for most of
// them, so figures swapped between rows passed TestIndexStats; here each
// is distinct and non-zero.
func TestIndexStatsRowsShowTheirOwnFigures(t *testing.T) {
	st := &api.IndexStats{Nodes: 1, Ranks: 2, Entries: 3,
		Blocks:       api.TierBlocks{Device: 4, Host: 5, Disk: 6, External: 7},
		OrphanEvents: 8, OrphanBlocks: 9, NeedResync: 10, OverCapacity: 11,
		Counters: api.IndexCounters{StoredBlocks: 12, RemovedBlocks: 13, Cleared: 14, UnknownRemoves: 15, Malformed: 16,
			OrphansHeld: 17, OrphansApplied: 18, OrphansDropped: 19, Remapped: 20, CapacityEvicted: 21, NameCollisions: 22},
		MemoryBytes: 23 << 20, HeapBytes: 24 << 20}
	var out bytes.Buffer
	if err := printIndexStats(&env{stdout: &out}, st); err != nil {
		t.Fatal(err)
	}
	want := []string{"nodes 1", "ranks 2", "entries 3", "blocks device 4", "blocks host 5", "blocks disk 6", "blocks external 7",
		"orphan events 8", "orphan blocks 9", "ranks needing resync 10", "ranks over capacity 11",
		"stored blocks 12", "removed blocks 13", "clears 14", "unknown removes 15", "malformed events 16",
		"orphans held 17", "orphans applied 18", "orphans dropped 19", "remapped hashes 20", "capacity evictions 21",
		"name collisions 22", "index memory (estimate) 23.0 MiB", "heap in use 24.0 MiB"}
	var got []string
	for _, line := range strings.Split(strings.TrimSpace(out.String()), "\n") {
		got = append(got, strings.Join(strings.Fields(line), " "))
	}
	if strings.Join(got, "\n") != strings.Join(want, "\n") {
		t.Fatalf("index stats:\n%s\nwant the rows\n%s", out.String(), strings.Join(want, "\n"))
	}
}
