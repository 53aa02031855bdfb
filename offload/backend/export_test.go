package backend

import "testing"

// SetCUDALibrary points OpenDevice and Detect at the driver library path
// (the fake driver) until the test ends.
func SetCUDALibrary(t testing.TB, path string) {
	old := cudaLibrary
	cudaLibrary = path
	t.Cleanup(func() { cudaLibrary = old })
}
