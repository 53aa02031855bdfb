package store

import (
	"math/rand/v2"
	"testing"

	"github.com/cockroachdb/pebble/v2/vfs"
)

// TestStateCrashKeepsEveryCommittedGroup: the state database has no WAL
// (see StateDB); a group is one ingested table, and the ingest syncs the
// table and the manifest, so a group is durable when its Commit returns
// (DESIGN.md "Atomic and durable per group"). A crash at any point, with
// any share of unsynced data kept, leaves exactly the groups committed,
// each group's records and its applied index together. (The test said
// "a crash may lose any batch committed after the last Sync" and checked
// only that much; from a review.)
func TestStateCrashKeepsEveryCommittedGroup(t *testing.T) {
	rng := rand.New(rand.NewPCG(crashTestSeed(t), 3))
	fs := vfs.NewCrashableMem()
	s, err := OpenState("fsm", StateOptions{FS: fs, Logger: logStoreTestLogger(t)})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	var synced uint64
	const batches = 400
	for i := uint64(1); i <= batches; i++ {
		b := s.NewBatch()
		// A group never passes through a memtable: each is one ingested
		// table, and the cursor every group rewrites makes it overlap the
		// last, so level 0 deepens and compacts between the crash points
		// too.
		for j := uint64(0); j < 500; j++ {
			b.PutEntry(i, uint32(j%4), rng.Uint64(), i, 1, uint32(j))
		}
		b.PutCursor(7, 0, i, 0)
		b.SetApplied(i, 1)
		if err := b.Commit(); err != nil {
			t.Fatal(err)
		}
		b.Close()
		if rng.IntN(40) == 0 {
			if err := s.Sync(); err != nil {
				t.Fatal(err)
			}
			synced = i
		}
		if rng.IntN(50) != 0 && i != batches {
			continue
		}
		unsynced := []int{0, 50, 100}[rng.IntN(3)]
		crashed := fs.CrashClone(vfs.CrashCloneCfg{UnsyncedDataPercent: unsynced, RNG: rand.New(rand.NewPCG(rng.Uint64(), 4))})
		c, err := OpenState("fsm", StateOptions{FS: crashed, Logger: logStoreTestLogger(t)})
		if err != nil {
			t.Fatalf("after batch %d: reopen crash image: %v", i, err)
		}
		applied, _, err := c.Applied()
		if err != nil {
			t.Fatal(err)
		}
		var cursor uint64
		if err := c.Scan(KindCursor, func(k, v []byte) error { cursor, _, err = DecodeCursor(v); return err }); err != nil {
			t.Fatal(err)
		}
		entries := 0
		if err := c.Scan(KindEntry, func(k, v []byte) error { entries++; return nil }); err != nil {
			t.Fatal(err)
		}
		c.Close()
		if applied != i || cursor != applied || entries != int(applied)*500 {
			t.Fatalf("crash after batch %d (synced %d, unsynced data kept %d%%): applied %d cursor %d entries %d",
				i, synced, unsynced, applied, cursor, entries)
		}
	}
}
