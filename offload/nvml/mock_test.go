//go:build cgo

package nvml_test

import (
	"errors"
	"strings"
	"sync/atomic"
	"testing"

	gonvml "github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock"

	"github.com/kvrouter/kvrouter/offload/nvml"
)

// A mock.Interface panics on any method whose func is unset, so this proves
// that after a failed Init nothing but Init is called, Close included.
func TestFailedInitCallsNothingElse(t *testing.T) {
	lib := &mock.Interface{InitFunc: func() gonvml.Return { return gonvml.ERROR_DRIVER_NOT_LOADED }}
	m := nvml.OpenLibrary(lib)
	inv, err := m.Inventory()
	if !errors.Is(err, nvml.ErrNoNVML) || !strings.Contains(err.Error(), "ERROR_DRIVER_NOT_LOADED") || len(inv.GPUs) != 0 {
		t.Fatalf("Inventory() = %+v, %v; want no GPUs and ErrNoNVML naming the driver", inv, err)
	}
	expectSamples(t, scrape(t, nvml.NewCollector(m)), "kvagent_gpu_count 0", "kvagent_gpu_nvml_up 0")
	if err := m.Close(); err != nil {
		t.Fatal(err)
	}
	if n := len(lib.InitCalls()); n != 1 {
		t.Fatalf("Init called %d times, want 1", n)
	}
}

func h200(index int, uuid string) *mock.Device {
	return &mock.Device{
		GetNameFunc: func() (string, gonvml.Return) { return "NVIDIA H200", gonvml.SUCCESS },
		GetUUIDFunc: func() (string, gonvml.Return) { return uuid, gonvml.SUCCESS },
		GetMemoryInfoFunc: func() (gonvml.Memory, gonvml.Return) {
			return gonvml.Memory{Total: 150754820096, Used: 1 << 30 * uint64(index+1)}, gonvml.SUCCESS
		},
		GetCurrPcieLinkGenerationFunc: func() (int, gonvml.Return) { return 5, gonvml.SUCCESS },
		GetCurrPcieLinkWidthFunc:      func() (int, gonvml.Return) { return 16, gonvml.SUCCESS },
		GetMaxPcieLinkGenerationFunc:  func() (int, gonvml.Return) { return 5, gonvml.SUCCESS },
		GetMaxPcieLinkWidthFunc:       func() (int, gonvml.Return) { return 16, gonvml.SUCCESS },
	}
}

func mockNode(devs ...*mock.Device) (*mock.Interface, *atomic.Int32) {
	var shutdowns atomic.Int32
	return &mock.Interface{
		InitFunc:                   func() gonvml.Return { return gonvml.SUCCESS },
		ShutdownFunc:               func() gonvml.Return { shutdowns.Add(1); return gonvml.SUCCESS },
		SystemGetDriverVersionFunc: func() (string, gonvml.Return) { return "570.86.15", gonvml.SUCCESS },
		DeviceGetCountFunc:         func() (int, gonvml.Return) { return len(devs), gonvml.SUCCESS },
		DeviceGetHandleByIndexFunc: func(i int) (gonvml.Device, gonvml.Return) {
			if i < 0 || i >= len(devs) {
				return nil, gonvml.ERROR_INVALID_ARGUMENT
			}
			return devs[i], gonvml.SUCCESS
		},
	}, &shutdowns
}

func TestCollectorExportsEveryGPU(t *testing.T) {
	lib, shutdowns := mockNode(h200(0, "GPU-aaaa"), h200(1, "GPU-bbbb"))
	m := nvml.OpenLibrary(lib)
	expectSamples(t, scrape(t, nvml.NewCollector(m)),
		`kvagent_gpu_count 2`,
		`kvagent_gpu_nvml_up 1`,
		`kvagent_gpu_info{gpu="0",name="NVIDIA H200",uuid="GPU-aaaa"} 1`,
		`kvagent_gpu_info{gpu="1",name="NVIDIA H200",uuid="GPU-bbbb"} 1`,
		`kvagent_gpu_memory_total_bytes{gpu="0"} 1.50754820096e+11`,
		`kvagent_gpu_memory_total_bytes{gpu="1"} 1.50754820096e+11`,
		`kvagent_gpu_memory_used_bytes{gpu="0"} 1.073741824e+09`,
		`kvagent_gpu_memory_used_bytes{gpu="1"} 2.147483648e+09`,
		`kvagent_gpu_pcie_link_generation{gpu="0"} 5`,
		`kvagent_gpu_pcie_link_generation{gpu="1"} 5`,
		`kvagent_gpu_pcie_link_width{gpu="0"} 16`,
		`kvagent_gpu_pcie_link_width{gpu="1"} 16`,
		`kvagent_gpu_pcie_link_max_generation{gpu="0"} 5`,
		`kvagent_gpu_pcie_link_max_generation{gpu="1"} 5`,
		`kvagent_gpu_pcie_link_max_width{gpu="0"} 16`,
		`kvagent_gpu_pcie_link_max_width{gpu="1"} 16`,
	)
	inv, err := m.Inventory()
	if err != nil || inv.DriverVersion != "570.86.15" || inv.GPUs[1].PCIeLinkGen != 5 {
		t.Fatalf("Inventory() = %+v, %v", inv, err)
	}
	for range 2 {
		if err := m.Close(); err != nil {
			t.Fatal(err)
		}
	}
	if n := shutdowns.Load(); n != 1 {
		t.Fatalf("Shutdown called %d times, want 1", n)
	}
	if _, err := m.Inventory(); !errors.Is(err, nvml.ErrClosed) {
		t.Fatalf("Inventory after Close: err = %v, want ErrClosed", err)
	}
}

// One unreadable attribute (a board without PCIe telemetry, a lost GPU) must
// not hide the rest.
func TestUnreadableAttributeHidesOnlyItself(t *testing.T) {
	partial := h200(0, "GPU-aaaa")
	partial.GetCurrPcieLinkWidthFunc = func() (int, gonvml.Return) { return 0, gonvml.ERROR_NOT_SUPPORTED }
	lib, _ := mockNode(partial, h200(1, "GPU-bbbb"), h200(2, "GPU-cccc"))
	lost := lib.DeviceGetHandleByIndexFunc
	lib.DeviceGetHandleByIndexFunc = func(i int) (gonvml.Device, gonvml.Return) {
		if i == 1 {
			return nil, gonvml.ERROR_GPU_IS_LOST
		}
		return lost(i)
	}
	m := nvml.OpenLibrary(lib)
	defer m.Close()
	inv, err := m.Inventory()
	if err != nil {
		t.Fatal(err)
	}
	if len(inv.GPUs) != 2 || inv.GPUs[0].Index != 0 || inv.GPUs[1].Index != 2 {
		t.Fatalf("GPUs = %+v; want 0 and 2 (1 is lost)", inv.GPUs)
	}
	if g := inv.GPUs[0]; g.PCIeLinkWidth != 0 || g.PCIeLinkGen != 5 || g.MemoryTotalBytes == 0 {
		t.Fatalf("gpu 0 = %+v; want width unknown, the rest read", g)
	}
	expectSamples(t, scrape(t, nvml.NewCollector(m), "kvagent_gpu_pcie_link_width"),
		`kvagent_gpu_pcie_link_width{gpu="2"} 16`)
}

// kvagent_gpu_count is the number NVML reports, a GPU whose handle cannot be
// opened included: it is the one sign of that GPU on the scrape, its
// per-GPU series being left out.
func TestGPUCountIsWhatNVMLReports(t *testing.T) {
	lib, _ := mockNode(h200(0, "GPU-aaaa"), h200(1, "GPU-bbbb"), h200(2, "GPU-cccc"))
	inner := lib.DeviceGetHandleByIndexFunc
	lib.DeviceGetHandleByIndexFunc = func(i int) (gonvml.Device, gonvml.Return) {
		if i == 1 {
			return nil, gonvml.ERROR_GPU_IS_LOST
		}
		return inner(i)
	}
	m := nvml.OpenLibrary(lib)
	defer m.Close()
	expectSamples(t, scrape(t, nvml.NewCollector(m), "kvagent_gpu_count", "kvagent_gpu_info"),
		`kvagent_gpu_count 3`,
		`kvagent_gpu_info{gpu="0",name="NVIDIA H200",uuid="GPU-aaaa"} 1`,
		`kvagent_gpu_info{gpu="2",name="NVIDIA H200",uuid="GPU-cccc"} 1`)
}
