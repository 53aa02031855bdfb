package engineapi

import (
	"bytes"
	"encoding/json"
	"errors"
	"runtime"
	"strings"
	"testing"

	"github.com/kvrouter/kvrouter/offload/backend"
)

const fuzzBlocks = 64

// checked decodes body as each request type and checks it against a
// region of fuzzBlocks blocks of 1024 bytes; it returns what was accepted.
func checked(t *testing.T, body []byte) {
	if q, err := decode[OffloadRequest](body, fuzzBlocks); err == nil && q.check(fuzzBlocks) == nil {
		seen := map[int]bool{}
		for _, b := range q.Blocks {
			if b.G1Block < 0 || b.G1Block >= fuzzBlocks || b.Hash == 0 || b.Parent == b.Hash || seen[b.G1Block] {
				t.Fatalf("accepted a bad offload block %+v", b)
			}
			seen[b.G1Block] = true
		}
	} else if err == nil && !errors.Is(q.check(fuzzBlocks), ErrBadRequest) {
		t.Fatal("an offload refusal is not ErrBadRequest")
	}
	if q, err := decode[FreeRequest](body, fuzzBlocks); err == nil && q.check(fuzzBlocks) == nil {
		for _, id := range q.G1Blocks {
			if id < 0 || id >= fuzzBlocks {
				t.Fatalf("accepted free of block %d", id)
			}
		}
	}
	if q, err := decode[OnboardRequest](body, fuzzBlocks); err == nil && q.check(fuzzBlocks) == nil {
		if len(q.Hashes) != len(q.G1Blocks) || q.TimeoutMs < 0 || q.TimeoutMs > MaxTimeoutMs {
			t.Fatalf("accepted a bad onboard %+v", q)
		}
		seen := map[int]bool{}
		for i, id := range q.G1Blocks {
			if id < 0 || id >= fuzzBlocks || q.Hashes[i] == 0 || seen[id] {
				t.Fatalf("accepted a bad onboard %+v", q)
			}
			seen[id] = true
		}
	}
	if q, err := decode[RegisterRequest](body, fuzzBlocks); err == nil {
		if h, l, err := q.check(backend.KindHost, 1024, fuzzBlocks); err == nil {
			if len(h) == 0 || l.BlockSize != 1024 || l.Blocks <= 0 || l.Blocks > fuzzBlocks {
				t.Fatalf("accepted a bad registration %+v", q)
			}
		}
	}
	if _, err := decode[LookupRequest](body, fuzzBlocks); err != nil && !errors.Is(err, ErrBadRequest) {
		t.Fatal("a decode error is not ErrBadRequest")
	}
}

// FuzzDecodeRequests: no body makes a decoder panic, and a request the
// checks accept is one the Manager can apply whole (go test -fuzz
// FuzzDecodeRequests ./offload/engineapi/).
func FuzzDecodeRequests(f *testing.F) {
	for _, s := range []string{
		`{"dp_rank":0,"blocks":[{"g1_block":3,"hash":7,"parent":0,"local":9,"priority":1}]}`,
		`{"dp_rank":0,"blocks":[{"g1_block":3,"hash":7},{"g1_block":3,"hash":8}]}`,
		`{"dp_rank":1,"g1_blocks":[0,63,64,-1]}`,
		`{"dp_rank":0,"hashes":[1,-1,18446744073709551615],"g1_blocks":[1,2,3],"timeout_ms":100}`,
		`{"dp_rank":0,"hashes":[1e3, 1.5, "2", null]}`,
		`{"dp_rank":0,"shm_path":"/dev/shm/x","block_size_bytes":1024,"num_blocks":64}`,
		`{"ipc_handle":"AAECAw==","block_size_bytes":1024,"num_blocks":9223372036854775807}`,
		`{} {}`, `[`, `null`, ``,
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, body []byte) { checked(t, body) })
}

func TestHashAcceptsSignedAndUnsignedIntegersOnly(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want uint64
		ok   bool
	}{
		{"0", 0, true}, {"7", 7, true}, {"18446744073709551615", 1<<64 - 1, true},
		{"-1", 1<<64 - 1, true}, {"-9223372036854775808", 1 << 63, true},
		{"18446744073709551616", 0, false}, {"-9223372036854775809", 0, false},
		{"1.0", 0, false}, {"1e3", 0, false}, {`"7"`, 0, false}, {"null", 0, false}, {"true", 0, false},
	} {
		var h Hash
		err := json.Unmarshal([]byte(tc.in), &h)
		if (err == nil) != tc.ok || (tc.ok && uint64(h) != tc.want) {
			t.Errorf("%s → %d, %v; want %d, ok %v", tc.in, uint64(h), err, tc.want, tc.ok)
		}
	}
}

// Each G1 block can be named once, so an offload or onboard naming more
// blocks than the region holds is refused before anything is sized by its
// length: a 2M-block request for a 64-block region allocated 72 MiB.
func TestCheckRefusesARequestLongerThanTheRegionWithoutSizingByIt(t *testing.T) {
	const regionBlocks = 64
	allocs := func(check func() error) uint64 {
		var before, after runtime.MemStats
		runtime.GC()
		runtime.ReadMemStats(&before)
		err := check()
		runtime.ReadMemStats(&after)
		if !errors.Is(err, ErrBadRequest) {
			t.Fatalf("check: %v, want ErrBadRequest", err)
		}
		return after.TotalAlloc - before.TotalAlloc
	}
	q := OffloadRequest{Blocks: make([]OffloadBlock, 2_000_000)}
	if n := allocs(func() error { return q.check(regionBlocks) }); n > 1<<20 {
		t.Errorf("refusing a %d-block offload for a %d-block region allocated %d KiB", len(q.Blocks), regionBlocks, n>>10)
	}
	o := OnboardRequest{Hashes: make([]Hash, 2_000_000), G1Blocks: make([]int, 2_000_000)}
	if n := allocs(func() error { return o.check(regionBlocks) }); n > 1<<20 {
		t.Errorf("refusing a %d-block onboard for a %d-block region allocated %d KiB", len(o.Hashes), regionBlocks, n>>10)
	}
}

// encoding/json takes null for a number as 0: {"dp_rank":null} would
// address rank 0 (a forgotten dp_rank is an error, not rank 0) and a null
// g1_block would offload G1 block 0. Null is refused where a scalar or an
// object is expected; it stays an empty list where a list is.
func TestDecodeRefusesNullForANumber(t *testing.T) {
	if q, err := decode[UnregisterRequest]([]byte(`{"dp_rank":null}`), MaxRequestBlocks); !errors.Is(err, ErrBadRequest) {
		t.Errorf(`{"dp_rank":null}: %+v, %v; want ErrBadRequest`, q, err)
	}
	if q, err := decode[OffloadRequest]([]byte(`{"dp_rank":1,"blocks":[{"g1_block":null,"hash":5,"priority":1}]}`), MaxRequestBlocks); !errors.Is(err, ErrBadRequest) {
		t.Errorf(`a null g1_block: %+v, %v; want ErrBadRequest`, q, err)
	}
	if q, err := decode[OffloadRequest]([]byte(`{"dp_rank":1,"blocks":[null]}`), MaxRequestBlocks); !errors.Is(err, ErrBadRequest) {
		t.Errorf(`a null block: %+v, %v; want ErrBadRequest`, q, err)
	}
	if q, err := decode[FreeRequest]([]byte(`{"dp_rank":1,"g1_blocks":null}`), MaxRequestBlocks); err != nil || q.DPRank != 1 || len(q.G1Blocks) != 0 {
		t.Errorf(`null g1_blocks: %+v, %v; want an empty list for rank 1`, q, err)
	}
}

// A 16 MiB body (the default MaxBodyBytes) of nested '[' is refused by
// encoding/json at depth 10000 before the keys are walked: Decoder.Token,
// which the key walk uses, keeps a delimiter stack of any depth and spent
// hundreds of MiB and seconds of CPU on it. A refusal returns a zero value.
func TestDecodeRefusesADeeplyNestedBodyCheaply(t *testing.T) {
	var b bytes.Buffer
	b.WriteString(`{"dp_rank":3,"hashes":[`)
	b.Write(bytes.Repeat([]byte("["), 16<<20-40))
	var ms runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&ms)
	before := ms.TotalAlloc
	q, err := decode[LookupRequest](b.Bytes(), MaxRequestBlocks)
	if !errors.Is(err, ErrBadRequest) {
		t.Fatalf("decode: %v, want ErrBadRequest", err)
	}
	runtime.ReadMemStats(&ms)
	if got := (ms.TotalAlloc - before) >> 20; got > 64 {
		t.Fatalf("refusing a 16 MiB nested body allocated %d MiB, want at most 64", got)
	}
	if q.DPRank != 0 || q.Hashes != nil {
		t.Fatalf("a refused body returned %+v, want the zero request", q)
	}
}

// From a review: the count limits applied only once the whole body was
// decoded, at some 90 bytes allocated per byte of body: a 16 MiB lookup of
// 8.4M one-digit hashes allocated 1.4 GiB (and took seconds) before it was
// refused for MaxRequestBlocks. A list longer than decode's limit is
// refused before encoding/json sees the body; one at the limit decodes.
func TestDecodeRefusesAListPastTheLimitBeforeDecodingIt(t *testing.T) {
	body := func(hashes int) []byte {
		var b bytes.Buffer
		b.WriteString(`{"dp_rank":0,"hashes":[`)
		for i := range hashes {
			if i > 0 {
				b.WriteByte(',')
			}
			b.WriteString("1")
		}
		b.WriteString("]}")
		return b.Bytes()
	}
	const most = MaxRequestBlocks
	if q, err := decode[LookupRequest](body(most), most); err != nil || len(q.Hashes) != most {
		t.Fatalf("a lookup of exactly %d hashes: %d hashes, %v", most, len(q.Hashes), err)
	}
	over := body(most + 1)
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	q, err := decode[LookupRequest](over, most)
	runtime.ReadMemStats(&after)
	if !errors.Is(err, ErrBadRequest) || q.Hashes != nil {
		t.Fatalf("a lookup of %d hashes, limit %d: %d hashes, %v; want ErrBadRequest", most+1, most, len(q.Hashes), err)
	}
	// Decoding it allocates some 11 MiB; the scan, nothing but the error.
	if d := after.TotalAlloc - before.TotalAlloc; d > 64<<10 {
		t.Fatalf("refusing a %d KiB body of %d hashes allocated %d KiB", len(over)>>10, most+1, d>>10)
	}
	// Commas in strings and in objects are not list items.
	if _, err := decode[OffloadRequest]([]byte(`{"dp_rank":0,"blocks":[{"g1_block":1,"hash":5,"local":9},{"g1_block":2,"hash":6,"local":9}]}`), 2); err != nil {
		t.Fatalf("an offload of 2 blocks, limit 2: %v", err)
	}
	if _, err := decode[RegisterRequest]([]byte(`{"dp_rank":0,"shm_path":"/a,b,c\\\",d","block_size_bytes":1,"num_blocks":1}`), 1); err != nil {
		t.Fatalf("a path with commas, limit 1: %v", err)
	}
}

// TestOffloadBlockNamesG1BlockHashAndLocal: an offload block must name its
// g1_block, hash and local; parent and priority may be left out (0: the
// first block of a sequence, the lowest priority that writes through).
// From a review: a block without "local" was accepted with content hash
// 0, and its G2/G3 STORE named the engine's hash under another block,
// which the router takes for the engine reusing the hash.
func TestOffloadBlockNamesG1BlockHashAndLocal(t *testing.T) {
	for _, tc := range []struct{ body, missing string }{
		{`{"dp_rank":0,"blocks":[{"g1_block":1,"hash":5,"parent":4,"priority":1}]}`, "local"},
		{`{"dp_rank":0,"blocks":[{"g1_block":1,"hash":5,"local":9},{"g1_block":2,"hash":6,"parent":5}]}`, "local"},
		{`{"dp_rank":0,"blocks":[{"hash":5,"local":9}]}`, "g1_block"},
		{`{"dp_rank":0,"blocks":[{"g1_block":1,"local":9}]}`, "hash"},
		{`{"dp_rank":0,"blocks":[{}]}`, "g1_block, hash, local"},
	} {
		q, err := decode[OffloadRequest]([]byte(tc.body), MaxRequestBlocks)
		if !errors.Is(err, ErrBadRequest) || !strings.Contains(err.Error(), tc.missing+" required") {
			t.Errorf("%s: %+v, %v; want ErrBadRequest naming %s", tc.body, q, err, tc.missing)
		}
	}
	q, err := decode[OffloadRequest]([]byte(`{"dp_rank":0,"blocks":[{"g1_block":1,"hash":5,"local":9}]}`), MaxRequestBlocks)
	if err != nil || q.check(8) != nil || q.Blocks[0].Parent != 0 || q.Blocks[0].Priority != 0 || q.Blocks[0].Local != 9 {
		t.Fatalf("a block without parent and priority: %+v, %v", q, err)
	}
}
