//go:build !cgo

package nvml

import "fmt"

// Open reports ErrNoNVML: go-nvml needs cgo, and this binary was built
// without it.
func Open(cfg Config) *Monitor {
	return unavailable(fmt.Errorf("%w: built without cgo (CGO_ENABLED=0)", ErrNoNVML), cfg.Logger)
}
