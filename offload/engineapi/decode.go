package engineapi

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"path/filepath"

	"github.com/kvrouter/kvrouter/offload/backend"
	"github.com/kvrouter/kvrouter/offload/manager"
)

// decode reads exactly one JSON object of type T from body: unknown
// fields, trailing data and type mismatches are ErrBadRequest.
func decode[T any](body []byte) (T, error) {
	var v T
	dec := json.NewDecoder(bytes.NewReader(body))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&v); err != nil {
		return v, fmt.Errorf("%w: %v", ErrBadRequest, err)
	}
	if _, err := dec.Token(); !errors.Is(err, io.EOF) {
		return v, fmt.Errorf("%w: data after the JSON object", ErrBadRequest)
	}
	return v, nil
}

// checkBlock refuses a G1 block id outside a region of n blocks.
func checkBlock(what string, id, n int) error {
	if id < 0 || id >= n {
		return fmt.Errorf("%w: %s %d: the region has %d blocks", ErrBadRequest, what, id, n)
	}
	return nil
}

// check refuses the whole request if any block is bad for a region of n
// blocks, so that an Offload never applies in part.
func (q *OffloadRequest) rank() uint32 { return q.DPRank }

func (q *OffloadRequest) check(n int) error {
	// Each G1 block can be named once: a longer request is refused before
	// anything is sized by its length.
	if len(q.Blocks) > n {
		return fmt.Errorf("%w: %d blocks: the region has %d", ErrBadRequest, len(q.Blocks), n)
	}
	seen := make(map[int]bool, len(q.Blocks))
	for i, b := range q.Blocks {
		if err := checkBlock(fmt.Sprintf("blocks[%d]: g1_block", i), b.G1Block, n); err != nil {
			return err
		}
		if b.Hash == 0 {
			return fmt.Errorf("%w: blocks[%d]: hash 0", ErrBadRequest, i)
		}
		if b.Parent == b.Hash {
			return fmt.Errorf("%w: blocks[%d]: block %d is its own parent", ErrBadRequest, i, uint64(b.Hash))
		}
		if seen[b.G1Block] {
			return fmt.Errorf("%w: blocks[%d]: g1_block %d named twice", ErrBadRequest, i, b.G1Block)
		}
		seen[b.G1Block] = true
	}
	return nil
}

func (q *FreeRequest) rank() uint32 { return q.DPRank }

func (q *FreeRequest) check(n int) error {
	if most := max(n, MaxRequestBlocks); len(q.G1Blocks) > most {
		return fmt.Errorf("%w: %d g1_blocks: at most %d in one request (the region has %d blocks); split it",
			ErrBadRequest, len(q.G1Blocks), most, n)
	}
	for i, id := range q.G1Blocks {
		if err := checkBlock(fmt.Sprintf("g1_blocks[%d]", i), id, n); err != nil {
			return err
		}
	}
	return nil
}

// check refuses a lookup of more than MaxRequestBlocks hashes: the pools'
// locks are held across the whole lookup.
func (q *LookupRequest) check() error {
	if len(q.Hashes) > MaxRequestBlocks {
		return fmt.Errorf("%w: %d hashes: at most %d in one lookup; split it", ErrBadRequest, len(q.Hashes), MaxRequestBlocks)
	}
	return nil
}

func (q *OnboardRequest) rank() uint32 { return q.DPRank }

func (q *OnboardRequest) check(n int) error {
	if len(q.Hashes) != len(q.G1Blocks) {
		return fmt.Errorf("%w: %d hashes for %d g1_blocks", ErrBadRequest, len(q.Hashes), len(q.G1Blocks))
	}
	if q.TimeoutMs < 0 || q.TimeoutMs > MaxTimeoutMs {
		return fmt.Errorf("%w: timeout_ms %d (want 0..%d)", ErrBadRequest, q.TimeoutMs, MaxTimeoutMs)
	}
	// Each G1 block can be named once: a longer request is refused before
	// anything is sized by its length.
	if len(q.G1Blocks) > n {
		return fmt.Errorf("%w: %d g1_blocks: the region has %d", ErrBadRequest, len(q.G1Blocks), n)
	}
	seen := make(map[int]bool, len(q.G1Blocks))
	for i, id := range q.G1Blocks {
		if err := checkBlock(fmt.Sprintf("g1_blocks[%d]", i), id, n); err != nil {
			return err
		}
		if q.Hashes[i] == 0 {
			return fmt.Errorf("%w: hashes[%d]: hash 0", ErrBadRequest, i)
		}
		if seen[id] {
			return fmt.Errorf("%w: g1_blocks[%d]: block %d named twice", ErrBadRequest, i, id)
		}
		seen[id] = true
	}
	return nil
}

// check returns the handle and layout of a registration for a backend of
// kind, whose pools hold blocks of blockSize bytes.
func (q *RegisterRequest) check(kind backend.Kind, blockSize int) (backend.IPCHandle, manager.Layout, error) {
	l := manager.Layout{BlockSize: q.BlockSizeBytes, Blocks: q.NumBlocks}
	if q.BlockSizeBytes != blockSize {
		return nil, l, fmt.Errorf("%w: block_size_bytes %d: the agent's pools hold blocks of %d bytes (--block-bytes)",
			ErrBadRequest, q.BlockSizeBytes, blockSize)
	}
	if err := l.Validate(); err != nil {
		return nil, l, fmt.Errorf("%w: %v", ErrBadRequest, err)
	}
	switch {
	case len(q.IPCHandle) > 0 && q.ShmPath != "":
		return nil, l, fmt.Errorf("%w: both ipc_handle and shm_path", ErrBadRequest)
	case len(q.IPCHandle) > 0:
		return backend.IPCHandle(q.IPCHandle), l, nil
	case q.ShmPath == "":
		return nil, l, fmt.Errorf("%w: neither ipc_handle nor shm_path", ErrBadRequest)
	case kind != backend.KindHost:
		return nil, l, fmt.Errorf("%w: shm_path needs the host backend; this agent copies with %s (send ipc_handle)",
			ErrBadRequest, kind)
	case !filepath.IsAbs(q.ShmPath):
		return nil, l, fmt.Errorf("%w: shm_path %q is not absolute", ErrBadRequest, q.ShmPath)
	}
	return backend.IPCHandle(q.ShmPath), l, nil
}
