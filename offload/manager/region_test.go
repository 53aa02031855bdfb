package manager_test

import (
	"errors"
	"os"
	"path/filepath"
	"testing"

	"github.com/kvrouter/kvrouter/offload/backend"
	"github.com/kvrouter/kvrouter/offload/manager"
)

func TestRegionAddressesBlocksAndRefusesBadIDs(t *testing.T) {
	r := manager.Region{Base: 0x10000, Layout: manager.Layout{BlockSize: 100, Blocks: 3}}
	check(t, r.Validate())
	for id, want := range []backend.Ptr{0x10000, 0x10000 + 100, 0x10000 + 200} {
		if got, err := r.Block(id); err != nil || got != want {
			t.Fatalf("Block(%d) = %#x, %v; want %#x", id, got, err, want)
		}
	}
	for _, id := range []int{-1, 3, 1 << 40} {
		if _, err := r.Block(id); !errors.Is(err, manager.ErrBadBlock) {
			t.Errorf("Block(%d): %v, want ErrBadBlock", id, err)
		}
	}
}

func TestRegionValidationRefusesImpossibleLayouts(t *testing.T) {
	for _, r := range []manager.Region{
		{Base: 0, Layout: manager.Layout{BlockSize: 1, Blocks: 1}},
		{Base: 1, Layout: manager.Layout{BlockSize: 0, Blocks: 1}},
		{Base: 1, Layout: manager.Layout{BlockSize: 1, Blocks: 0}},
		{Base: 1, Layout: manager.Layout{BlockSize: -1, Blocks: 4}},
		{Base: 1, Layout: manager.Layout{BlockSize: 1 << 40, Blocks: 1 << 40}},
	} {
		if err := r.Validate(); !errors.Is(err, manager.ErrInvalid) {
			t.Errorf("Validate(%+v): %v, want ErrInvalid", r, err)
		}
	}
}

func TestMapRegionRefusesAnExportShorterThanTheLayout(t *testing.T) {
	be, err := backend.NewHost()
	check(t, err)
	defer be.Close()
	path := filepath.Join(t.TempDir(), "g1")
	check(t, os.WriteFile(path, make([]byte, 3*bs), 0o600))
	if _, err := manager.MapRegion(be, backend.IPCHandle(path), manager.Layout{BlockSize: bs, Blocks: 4}); !errors.Is(err, backend.ErrOutOfRange) {
		t.Fatalf("MapRegion of 3 blocks as 4: %v, want ErrOutOfRange", err)
	}
	mp, err := manager.MapRegion(be, backend.IPCHandle(path), manager.Layout{BlockSize: bs, Blocks: 3})
	check(t, err)
	if _, err := mp.Block(2); err != nil {
		t.Fatal(err)
	}
	check(t, mp.Close())
	check(t, mp.Close())
}
