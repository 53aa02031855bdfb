//go:build cgo

package nvml

import (
	"fmt"
	"log/slog"

	gonvml "github.com/NVIDIA/go-nvml/pkg/nvml"
)

// Open loads NVML and initialises it. It never fails: when NVML is missing
// or Init fails, the Monitor reports ErrNoNVML (see Err) and calls nothing.
func Open(cfg Config) *Monitor {
	var opts []gonvml.LibraryOption
	path := "libnvidia-ml.so.1"
	if cfg.Library != "" {
		path = cfg.Library
		opts = append(opts, gonvml.WithLibraryPath(path))
	}
	return openLibrary(gonvml.New(opts...), path, cfg.Logger)
}

// OpenLibrary initialises an NVML interface the caller made (a mock in
// tests, or a library with custom options). Like Open it never fails, and it
// calls nothing but Init on lib unless Init succeeds. It logs through
// slog.Default().
func OpenLibrary(lib gonvml.Interface) *Monitor { return openLibrary(lib, "NVML", nil) }

func openLibrary(lib gonvml.Interface, name string, log *slog.Logger) *Monitor {
	// go-nvml's Init loads the library first and returns
	// ERROR_LIBRARY_NOT_FOUND, without calling into C, when it is missing.
	if ret := lib.Init(); ret != gonvml.SUCCESS {
		return unavailable(fmt.Errorf("%w: nvmlInit (%s): %s", ErrNoNVML, name, retName(ret)), log)
	}
	log = logger(log)
	return &Monitor{log: log, drv: &nvmlDriver{lib: lib, log: log}}
}

type nvmlDriver struct {
	lib gonvml.Interface
	log *slog.Logger
}

func (d *nvmlDriver) inventory() (Inventory, error) {
	var inv Inventory
	if v, ret := d.lib.SystemGetDriverVersion(); ret == gonvml.SUCCESS {
		inv.DriverVersion = v
	}
	n, ret := d.lib.DeviceGetCount()
	if ret != gonvml.SUCCESS {
		return Inventory{}, fmt.Errorf("nvmlDeviceGetCount: %s", retName(ret))
	}
	inv.Count = n
	for i := range n {
		dev, ret := d.lib.DeviceGetHandleByIndex(i)
		if ret != gonvml.SUCCESS {
			// A lost or inaccessible GPU: skip it, report the rest.
			d.log.Warn("nvml: cannot open GPU", "gpu", i, "err", retName(ret))
			continue
		}
		inv.GPUs = append(inv.GPUs, readGPU(i, dev, d.log))
	}
	return inv, nil
}

// readGPU reads each attribute on its own, leaving the ones NVML refuses
// (ERROR_NOT_SUPPORTED on some boards, ERROR_NO_PERMISSION in containers) at
// zero.
func readGPU(i int, dev gonvml.Device, log *slog.Logger) GPU {
	g := GPU{Index: i}
	note := func(attr string, ret gonvml.Return) bool {
		if ret != gonvml.SUCCESS {
			log.Debug("nvml: attribute unavailable", "gpu", i, "attr", attr, "err", retName(ret))
			return false
		}
		return true
	}
	var ret gonvml.Return
	if g.Name, ret = dev.GetName(); !note("name", ret) {
		g.Name = ""
	}
	if g.UUID, ret = dev.GetUUID(); !note("uuid", ret) {
		g.UUID = ""
	}
	if mem, ret := dev.GetMemoryInfo(); note("memory", ret) {
		g.MemoryTotalBytes, g.MemoryUsedBytes = mem.Total, mem.Used
	}
	if v, ret := dev.GetCurrPcieLinkGeneration(); note("pcie_gen", ret) {
		g.PCIeLinkGen = v
	}
	if v, ret := dev.GetCurrPcieLinkWidth(); note("pcie_width", ret) {
		g.PCIeLinkWidth = v
	}
	if v, ret := dev.GetMaxPcieLinkGeneration(); note("pcie_gen_max", ret) {
		g.PCIeLinkGenMax = v
	}
	if v, ret := dev.GetMaxPcieLinkWidth(); note("pcie_width_max", ret) {
		g.PCIeLinkWidthMax = v
	}
	return g
}

func (d *nvmlDriver) shutdown() error {
	if ret := d.lib.Shutdown(); ret != gonvml.SUCCESS {
		return fmt.Errorf("nvmlShutdown: %s", retName(ret))
	}
	return nil
}

// retName names an NVML return code without calling NVML: Return.Error()
// calls nvmlErrorString once the library is loaded, even when Init failed.
func retName(r gonvml.Return) string {
	if name, ok := retNames[r]; ok {
		return name
	}
	return fmt.Sprintf("NVML return %d", int32(r))
}

var retNames = map[gonvml.Return]string{
	gonvml.ERROR_UNINITIALIZED:           "ERROR_UNINITIALIZED",
	gonvml.ERROR_INVALID_ARGUMENT:        "ERROR_INVALID_ARGUMENT",
	gonvml.ERROR_NOT_SUPPORTED:           "ERROR_NOT_SUPPORTED",
	gonvml.ERROR_NO_PERMISSION:           "ERROR_NO_PERMISSION",
	gonvml.ERROR_NOT_FOUND:               "ERROR_NOT_FOUND",
	gonvml.ERROR_DRIVER_NOT_LOADED:       "ERROR_DRIVER_NOT_LOADED",
	gonvml.ERROR_LIBRARY_NOT_FOUND:       "ERROR_LIBRARY_NOT_FOUND",
	gonvml.ERROR_FUNCTION_NOT_FOUND:      "ERROR_FUNCTION_NOT_FOUND",
	gonvml.ERROR_GPU_IS_LOST:             "ERROR_GPU_IS_LOST",
	gonvml.ERROR_LIB_RM_VERSION_MISMATCH: "ERROR_LIB_RM_VERSION_MISMATCH",
	gonvml.ERROR_UNKNOWN:                 "ERROR_UNKNOWN",
}
