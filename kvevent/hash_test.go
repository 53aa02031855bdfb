package kvevent

import "testing"

// The vectors below were computed with Debian's python3-xxhash, an
// implementation this project did not write:
//
//	xxhash.xxh3_64_intdigest(b"".join(struct.pack("<I", t) for t in toks), seed=1337)
//	xxhash.xxh3_64_intdigest(struct.pack("<QQ", parent, local), seed=1337)
//
// A change to any of them means the router no longer agrees with engines.

func seq(from, n uint32) []uint32 {
	out := make([]uint32, n)
	for i := range out {
		out[i] = from + uint32(i)
	}
	return out
}

func TestLocalHashMatchesIndependentXXH3(t *testing.T) {
	cases := []struct {
		name   string
		tokens []uint32
		seed   uint64
		want   uint64
	}{
		{"empty", nil, Seed, 0xd1f3e77444430ab9},
		{"1..16", seq(1, 16), Seed, 0xea06fc71a5ee6e88},
		{"zeros", make([]uint32, 16), Seed, 0x4ca6490661395090},
		{"max token", []uint32{4294967295, 7, 123456789, 42}, Seed, 0xc189d9f244b6fd7b},
		{"300 tokens (heap buffer)", seq(0, 300), Seed, 0x1474c801f1576d1c},
		{"lora seed", seq(1, 16), SeedFor("my-adapter", ""), 0xe7c4d1518de44e34},
		{"lora and salt seed", seq(1, 16), SeedFor("my-adapter", "salt-1"), 0x7a1b34200787a302},
	}
	for _, c := range cases {
		if got := LocalHash(c.tokens, c.seed); got != c.want {
			t.Errorf("%s: LocalHash = %#x, want %#x", c.name, got, c.want)
		}
	}
}

func TestSeedForDerivation(t *testing.T) {
	if got := SeedFor("", ""); got != Seed {
		t.Fatalf("no lora, no salt: seed %d, want %d", got, Seed)
	}
	if got, want := SeedFor("my-adapter", ""), uint64(0x20c184514a4c9eac); got != want {
		t.Fatalf("lora seed %#x, want %#x", got, want)
	}
	// From python3-xxhash: (1337 + xxh3_64(lora) + xxh3_64(salt, seed=1337)) mod 2^64.
	if got, want := SeedFor("my-adapter", "salt-1"), uint64(0x4dc5905549ba4630); got != want {
		t.Fatalf("lora+salt seed %#x, want %#x", got, want)
	}
	if got, want := SeedFor("", "salt-1"), uint64(0x2d040c03ff6dacbd); got != want {
		t.Fatalf("salt seed %#x, want %#x", got, want)
	}
	// A salt does not hash like an adapter of its name, nor lora and salt
	// like each other swapped (from a review: both added XXH3(name)).
	if SeedFor("", "salt-1") == SeedFor("salt-1", "") {
		t.Fatal("salt X hashes like LoRA X")
	}
	if SeedFor("a", "b") == SeedFor("b", "a") {
		t.Fatal("SeedFor(a, b) == SeedFor(b, a)")
	}
}

func TestSequenceHashesChain(t *testing.T) {
	toks := seq(0, 48)
	local := LocalHashes(nil, toks, 16, Seed)
	wantLocal := []uint64{0xd47a8f41c833328a, 0xd43939178abd00db, 0x4cc8f942aaf401a2}
	wantSeq := []uint64{0xd47a8f41c833328a, 0xbf15dffb16447f38, 0xa4dda066f3c1e1a0}
	if len(local) != 3 {
		t.Fatalf("got %d local hashes, want 3", len(local))
	}
	for i := range wantLocal {
		if local[i] != wantLocal[i] {
			t.Errorf("local[%d] = %#x, want %#x", i, local[i], wantLocal[i])
		}
	}
	got := SequenceHashes(nil, local)
	for i := range wantSeq {
		if got[i] != wantSeq[i] {
			t.Errorf("seq[%d] = %#x, want %#x", i, got[i], wantSeq[i])
		}
	}
}

func TestPartialTrailingBlockIsNotHashed(t *testing.T) {
	if n := len(LocalHashes(nil, seq(0, 47), 16, Seed)); n != 2 {
		t.Fatalf("47 tokens at block size 16 gave %d hashes, want 2", n)
	}
	if n := len(LocalHashes(nil, seq(0, 15), 16, Seed)); n != 0 {
		t.Fatalf("15 tokens gave %d hashes, want 0", n)
	}
	if n := len(LocalHashes(nil, seq(0, 64), 0, Seed)); n != 0 {
		t.Fatalf("block size 0 gave %d hashes, want 0", n)
	}
}

func TestLocalHashesDoesNotAllocateForShortBlocks(t *testing.T) {
	toks := seq(0, 1024)
	dst := make([]uint64, 0, 64)
	if n := testing.AllocsPerRun(100, func() { dst = LocalHashes(dst[:0], toks, 16, Seed) }); n != 0 {
		t.Fatalf("LocalHashes allocated %.1f times per run, want 0", n)
	}
}

func BenchmarkLocalHashes16(b *testing.B) {
	toks := seq(0, 128*16)
	dst := make([]uint64, 0, 128)
	b.SetBytes(int64(len(toks) * 4))
	for b.Loop() {
		dst = LocalHashes(dst[:0], toks, 16, Seed)
	}
}
