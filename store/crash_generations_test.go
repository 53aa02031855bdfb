package store

import (
	"math/rand/v2"
	"testing"

	"github.com/cockroachdb/pebble/v2/vfs"
)

// TestCrashRecoverCrashAgain: crash, recover on the crashed image, keep
// writing (appends, head compactions, tail truncations, stable writes),
// crash again, for several generations: every acknowledged write survives
// every later crash, and the recovered store equals the model exactly.
func TestCrashRecoverCrashAgain(t *testing.T) {
	seed := crashTestSeed(t)
	rng := rand.New(rand.NewPCG(seed, 7))
	fs := vfs.NewCrashableMem()
	s := openCrashStore(t, fs)
	w := newCrashWorkload(rng, s)
	for gen := 0; gen < 6; gen++ {
		ops := 20 + rng.IntN(80)
		for op := 0; op < ops; op++ {
			if err := w.step(); err != nil {
				t.Fatalf("gen %d op %d: %v", gen, op, err)
			}
		}
		unsynced := []int{0, 30, 70, 100}[rng.IntN(4)]
		crashed := fs.CrashClone(vfs.CrashCloneCfg{UnsyncedDataPercent: unsynced, RNG: rand.New(rand.NewPCG(rng.Uint64(), 9))})
		_ = s.Close()
		got := readState(t, crashed)
		if !got.equal(w.model) {
			t.Fatalf("gen %d (unsynced %d%%):\n got  %v\n want %v", gen, unsynced, got, w.model)
		}
		fs = crashed
		s = openCrashStore(t, fs)
		w.s = s
	}
	_ = s.Close()
}

// TestCrashWithWALRecycling: the same with Pebble's WAL recycling left on,
// production's path (the other crash tests wrap the FS in noReuseFS).
// Crash images are taken between operations only, so the
// CrashClone/ReuseForWrite deadlock noted at noReuseFS cannot happen.
func TestCrashWithWALRecycling(t *testing.T) {
	seed := crashTestSeed(t)
	rng := rand.New(rand.NewPCG(seed, 11))
	open := func(fs vfs.FS) *LogStore {
		s, err := OpenLogStore("raft", LogStoreOptions{FS: fs, Logger: logStoreTestLogger(t), tune: smallMemtables})
		if err != nil {
			t.Fatalf("open: %v", err)
		}
		return s
	}
	fs := vfs.NewCrashableMem()
	s := open(fs)
	w := newCrashWorkload(rng, s)
	for gen := 0; gen < 6; gen++ {
		for op := 0; op < 40+rng.IntN(120); op++ {
			if err := w.step(); err != nil {
				t.Fatalf("gen %d op %d: %v", gen, op, err)
			}
			if rng.IntN(15) == 0 {
				unsynced := []int{0, 30, 70, 100}[rng.IntN(4)]
				img := fs.CrashClone(vfs.CrashCloneCfg{UnsyncedDataPercent: unsynced, RNG: rand.New(rand.NewPCG(rng.Uint64(), 9))})
				if got := readState(t, img); !got.equal(w.model) {
					t.Fatalf("gen %d op %d (unsynced %d%%):\n got  %v\n want %v", gen, op, unsynced, got, w.model)
				}
			}
		}
		unsynced := []int{0, 30, 70, 100}[rng.IntN(4)]
		crashed := fs.CrashClone(vfs.CrashCloneCfg{UnsyncedDataPercent: unsynced, RNG: rand.New(rand.NewPCG(rng.Uint64(), 9))})
		_ = s.Close()
		fs = crashed
		s = open(fs)
		w.s = s
	}
	_ = s.Close()
}
