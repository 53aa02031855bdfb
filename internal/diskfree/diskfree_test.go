package diskfree_test

import (
	"testing"

	"github.com/kvrouter/kvrouter/internal/diskfree"
)

func TestAvailableOfATempDirIsSomeBytesAndOfNoDirAnError(t *testing.T) {
	if n, err := diskfree.Available(t.TempDir()); err != nil || n == 0 {
		t.Fatalf("Available(a temp dir) = %d, %v; want some bytes", n, err)
	}
	if _, err := diskfree.Available(t.TempDir() + "/missing"); err == nil {
		t.Fatal("Available(a missing dir) answered no error")
	}
}
