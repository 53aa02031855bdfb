package pool

import (
	"bytes"
	"slices"
	"strings"
	"testing"

	"github.com/cockroachdb/pebble/v2"

	"github.com/kvrouter/kvrouter/internal/testlog"
)

// putChain stores blocks 1 ← 2 ← 3 and closes the pool.
func putChain(t *testing.T, p *DiskPool) {
	t.Helper()
	if n, err := p.Put([]Block{{Hash: 1, Local: 11}, {Hash: 2, Parent: 1, Local: 22}, {Hash: 3, Parent: 2, Local: 33}},
		[][]byte{blockBytes(1), blockBytes(2), blockBytes(3)}); n != 3 || err != nil {
		t.Fatalf("put: %d, %v", n, err)
	}
	if err := p.Close(); err != nil {
		t.Fatal(err)
	}
}

// A pool opened under another identity than the one that wrote it (another
// model, salt or worker, as kvagent names them) drops its blocks instead
// of restoring them, says so once with the count, and records the new
// identity: the next open under it keeps what it stores.
func TestDiskPoolOfAnotherIdentityDropsItsBlocks(t *testing.T) {
	dir := t.TempDir()
	putChain(t, openIdentity(t, dir, nil, "model=a"))

	log := &testlog.Buffer{}
	p := openIdentity(t, dir, log, "model=a")
	if st := p.Stats(); st.Used != 3 {
		t.Fatalf("reopened under the same identity: %d blocks, want 3", st.Used)
	}
	if log.String() != "" {
		t.Fatalf("reopened under the same identity, it logged %q", log.String())
	}
	if err := p.Close(); err != nil {
		t.Fatal(err)
	}

	p = openIdentity(t, dir, log, "model=b")
	if st := p.Stats(); st.Used != 0 {
		t.Fatalf("opened under another identity: %d blocks restored, want none", st.Used)
	}
	if evs, _ := p.Dump(); len(evs) != 0 {
		t.Fatalf("opened under another identity, it dumps %v", evs)
	}
	if got := log.Lines("written for another identity", "blocks=3", `was="model=a"`, `now="model=b"`); len(got) != 1 {
		t.Fatalf("the drop was not logged once with its count and both identities: %q", log.String())
	}
	if got := keys(t, p); !slices.EqualFunc(got, [][]byte{{kindHeader}, {kindIdent}}, bytes.Equal) {
		t.Fatalf("keys after the drop: %x, want only the header and the identity", got)
	}
	if n, err := p.Put([]Block{{Hash: 2, Local: 22}}, [][]byte{blockBytes(2)}); n != 1 || err != nil {
		t.Fatalf("put after the drop: %d, %v", n, err)
	}
	if err := p.Close(); err != nil {
		t.Fatal(err)
	}

	log = &testlog.Buffer{}
	p = openIdentity(t, dir, log, "model=b")
	if got := p.Lookup([]uint64{1, 2, 3}, nil); !slices.Equal(got, []bool{false, true, false}) || log.String() != "" {
		t.Fatalf("reopened under the new identity: Lookup(1, 2, 3) = %v, logged %q; want only 2, nothing logged", got, log.String())
	}
	buf := make([]byte, internalBlock)
	if err := p.Read(2, buf); err != nil || !bytes.Equal(buf, blockBytes(2)) {
		t.Fatalf("read block 2 after the drop: %v", err)
	}
}

// A pool written before identities were recorded (no identity key) is
// not known to match: it is emptied at its first open, once.
func TestDiskPoolWithoutARecordedIdentityDropsItsBlocksOnce(t *testing.T) {
	dir := t.TempDir()
	p := openIdentity(t, dir, nil, "model=a")
	if err := p.db.Delete([]byte{kindIdent}, pebble.NoSync); err != nil { // as an older build wrote it
		t.Fatal(err)
	}
	putChain(t, p)

	log := &testlog.Buffer{}
	p = openIdentity(t, dir, log, "model=a")
	if st := p.Stats(); st.Used != 0 {
		t.Fatalf("a pool without an identity: %d blocks restored, want none", st.Used)
	}
	if got := log.Lines("records no identity", "blocks=3", "older kvagent"); len(got) != 1 {
		t.Fatalf("the drop was not logged once with its count and why: %q", log.String())
	}
	putChain(t, p)
	log = &testlog.Buffer{}
	p = openIdentity(t, dir, log, "model=a")
	if st := p.Stats(); st.Used != 3 || strings.Contains(log.String(), "dropped") {
		t.Fatalf("second open: %d blocks, logged %q; want 3 kept, nothing dropped", st.Used, log.String())
	}
}
