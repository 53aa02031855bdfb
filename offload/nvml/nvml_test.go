package nvml_test

import (
	"errors"
	"os"
	"testing"

	"github.com/kvrouter/kvrouter/offload/nvml"
)

// expectGPUEnv, when "1", makes "no GPU" a failure (scripts/gpu-check.sh).
const expectGPUEnv = "KVROUTER_EXPECT_GPU"

// Any NVML call after a failed Init may kill the process; a node without
// NVML must get "no GPU" and carry on.
func TestMissingNVMLReportsNoGPUAndTheProcessSurvives(t *testing.T) {
	m := nvml.Open(nvml.Config{Library: "/nonexistent/libnvidia-ml.so.1"})
	if m.Available() {
		t.Fatal("Available() = true without a library")
	}
	if err := m.Err(); !errors.Is(err, nvml.ErrNoNVML) {
		t.Fatalf("Err() = %v, want ErrNoNVML", err)
	}
	inv, err := m.Inventory()
	if !errors.Is(err, nvml.ErrNoNVML) || len(inv.GPUs) != 0 {
		t.Fatalf("Inventory() = %+v, %v; want no GPUs and ErrNoNVML", inv, err)
	}
	expectSamples(t, scrape(t, nvml.NewCollector(m)), "kvagent_gpu_count 0", "kvagent_gpu_nvml_up 0")
	for range 2 {
		if err := m.Close(); err != nil {
			t.Fatalf("Close: %v", err)
		}
	}
	if _, err := m.Inventory(); !errors.Is(err, nvml.ErrClosed) {
		t.Fatalf("Inventory after Close: err = %v, want ErrClosed", err)
	}
}

// TestInventoryOnThisMachine reads the real NVML when there is one; with
// KVROUTER_EXPECT_GPU=1 it must find a GPU with a name, UUID and memory.
func TestInventoryOnThisMachine(t *testing.T) {
	m := nvml.Open(nvml.Config{})
	defer m.Close()
	inv, err := m.Inventory()
	if err != nil {
		if os.Getenv(expectGPUEnv) == "1" {
			t.Fatalf("%s=1 but: %v", expectGPUEnv, err)
		}
		if !errors.Is(err, nvml.ErrNoNVML) {
			t.Fatalf("Inventory: %v", err)
		}
		t.Skipf("no GPU: %v", err)
	}
	t.Logf("driver %s, %d GPUs", inv.DriverVersion, len(inv.GPUs))
	for _, g := range inv.GPUs {
		t.Logf("gpu %d: %s %s memory %d/%d MiB, PCIe gen %d x%d (max gen %d x%d)",
			g.Index, g.Name, g.UUID, g.MemoryUsedBytes>>20, g.MemoryTotalBytes>>20,
			g.PCIeLinkGen, g.PCIeLinkWidth, g.PCIeLinkGenMax, g.PCIeLinkWidthMax)
		if g.Name == "" || g.UUID == "" || g.MemoryTotalBytes == 0 {
			t.Errorf("gpu %d: name, UUID or memory missing: %+v", g.Index, g)
		}
	}
	if os.Getenv(expectGPUEnv) == "1" && len(inv.GPUs) == 0 {
		t.Fatal("NVML initialised but reports no GPU")
	}
	if n := len(scrape(t, nvml.NewCollector(m), "kvagent_gpu_info")); n != len(inv.GPUs) {
		t.Fatalf("kvagent_gpu_info series = %d, want %d", n, len(inv.GPUs))
	}
}

// A zero Monitor is documented as usable (logger) and is not Available: Err
// must say why rather than nil, and Inventory must wrap ErrNoNVML, which the
// Collector takes for "no GPU" instead of warning on every scrape.
func TestZeroMonitorErrAgreesWithAvailable(t *testing.T) {
	var m nvml.Monitor
	if m.Available() {
		t.Fatal("zero Monitor is Available")
	}
	if err := m.Err(); !errors.Is(err, nvml.ErrNoNVML) {
		t.Errorf("zero Monitor: Err() = %v, want ErrNoNVML", err)
	}
	if _, err := m.Inventory(); !errors.Is(err, nvml.ErrNoNVML) {
		t.Errorf("zero Monitor: Inventory() err = %v, want one wrapping ErrNoNVML", err)
	}
}
