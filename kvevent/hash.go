package kvevent

import (
	"encoding/binary"

	"github.com/zeebo/xxh3"
)

// Seed is the XXH3 seed of every block hash, as engines and the reference
// router use it.
const Seed uint64 = 1337

// SeedFor returns the content-hash seed of blocks under a LoRA adapter
// and/or a cache salt. The LoRA name adds its unseeded XXH3-64, the salt
// its XXH3-64 seeded with Seed, with wrapping arithmetic:
//
//	seed = 1337 + XXH3(lora) + XXH3(salt, seed 1337)    (each term only when non-empty)
//
// so that the same tokens under another adapter or salt land on another
// path of the tree, no adapter and no salt gives the plain Seed, and a salt
// never hashes like an adapter of the same name (nor lora and salt like
// each other swapped): the two terms are of different functions.
func SeedFor(lora, salt string) uint64 {
	s := Seed
	if lora != "" {
		s += xxh3.HashString(lora)
	}
	if salt != "" {
		s += xxh3.HashStringSeed(salt, Seed)
	}
	return s
}

// LocalHash returns the content hash of one block: XXH3-64 with the given
// seed over its token ids, each written as 4 bytes little-endian.
func LocalHash(tokens []uint32, seed uint64) uint64 {
	var stack [256 * 4]byte
	var buf []byte
	if len(tokens)*4 <= len(stack) {
		buf = stack[:len(tokens)*4]
	} else {
		buf = make([]byte, len(tokens)*4)
	}
	for i, t := range tokens {
		binary.LittleEndian.PutUint32(buf[i*4:], t)
	}
	return xxh3.HashSeed(buf, seed)
}

// LocalHashes appends to dst the content hash of every full block of
// tokens and returns it. A trailing partial block is not hashed: it never
// matches. blockSize must be positive.
func LocalHashes(dst []uint64, tokens []uint32, blockSize int, seed uint64) []uint64 {
	if blockSize <= 0 {
		return dst
	}
	for i := 0; i+blockSize <= len(tokens); i += blockSize {
		dst = append(dst, LocalHash(tokens[i:i+blockSize], seed))
	}
	return dst
}

// SequenceHash chains a block's content hash onto its parent's sequence
// hash: XXH3-64(le64(parent) || le64(local), seed 1337). The first block's
// sequence hash is its content hash.
func SequenceHash(parent, local uint64) uint64 {
	var b [16]byte
	binary.LittleEndian.PutUint64(b[:8], parent)
	binary.LittleEndian.PutUint64(b[8:], local)
	return xxh3.HashSeed(b[:], Seed)
}

// SequenceHashes appends to dst the sequence hash of every block given its
// content hashes: seq_0 = local_0, seq_i = SequenceHash(seq_{i-1}, local_i).
func SequenceHashes(dst []uint64, local []uint64) []uint64 {
	for i, l := range local {
		if i == 0 {
			dst = append(dst, l)
			continue
		}
		dst = append(dst, SequenceHash(dst[len(dst)-1], l))
	}
	return dst
}
