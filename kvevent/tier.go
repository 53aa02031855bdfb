package kvevent

import (
	"fmt"
	"strings"
)

// Tier is the storage tier a block lives in. Lower is faster.
type Tier uint8

// The four tiers, in walk order (device first).
const (
	TierDevice     Tier = iota // G1: the engine's GPU cache
	TierHostPinned             // G2: pinned host memory
	TierDisk                   // G3: local disk
	TierExternal               // G4: remote or shared storage
)

// NumTiers is the number of tiers; Tier values are in [0, NumTiers).
const NumTiers = 4

var tierNames = [NumTiers]string{"device", "host", "disk", "external"}

// String returns the metric label of the tier: device, host, disk or external.
func (t Tier) String() string {
	if t < NumTiers {
		return tierNames[t]
	}
	return fmt.Sprintf("tier(%d)", uint8(t))
}

// Valid reports whether t is one of the four tiers.
func (t Tier) Valid() bool { return t < NumTiers }

// Mask is a residency bitmask: bit t is set when the block is held in tier t.
type Mask uint8

// Bit returns the mask with only tier t set.
func (t Tier) Bit() Mask { return 1 << t }

// Has reports whether tier t is set in m.
func (m Mask) Has(t Tier) bool { return m&(1<<t) != 0 }

// ParseTier parses a tier's label as String prints it.
func ParseTier(s string) (Tier, error) {
	for i, n := range tierNames {
		if strings.EqualFold(s, n) {
			return Tier(i), nil
		}
	}
	return 0, fmt.Errorf("%w: %q (want device, host, disk or external)", ErrUnknownTier, s)
}

// ParseMedium maps an engine's `medium` string to a tier, case-insensitively,
// per semantics.md §2. The empty string (nil on the wire) means the device.
func ParseMedium(medium string) (Tier, error) {
	// The common spellings are matched without allocating; EqualFold is the
	// fallback for mixed case.
	switch medium {
	case "", "GPU", "DEVICE", "gpu", "device":
		return TierDevice, nil
	case "CPU", "CPU_PINNED", "CPU_TIER1", "cpu":
		return TierHostPinned, nil
	case "CPU_TIER2", "DISK", "NVME", "STORAGE", "disk":
		return TierDisk, nil
	case "EXTERNAL", "NETWORK", "REMOTE", "SHARED":
		return TierExternal, nil
	}
	for _, m := range mediums {
		if strings.EqualFold(medium, m.name) {
			return m.tier, nil
		}
	}
	return 0, fmt.Errorf("%w: %q", ErrUnknownMedium, medium)
}

var mediums = []struct {
	name string
	tier Tier
}{
	{"GPU", TierDevice}, {"DEVICE", TierDevice},
	{"CPU", TierHostPinned}, {"CPU_PINNED", TierHostPinned}, {"CPU_TIER1", TierHostPinned},
	{"CPU_TIER2", TierDisk}, {"DISK", TierDisk}, {"NVME", TierDisk}, {"STORAGE", TierDisk},
	{"EXTERNAL", TierExternal}, {"NETWORK", TierExternal}, {"REMOTE", TierExternal}, {"SHARED", TierExternal},
}
