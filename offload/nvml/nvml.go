// Package nvml reports the node's NVIDIA GPUs (inventory and telemetry: name,
// UUID, memory, PCIe link) through NVML, and exports them as Prometheus
// metrics for the node agent.
//
// Invariants:
//   - No NVML function is called unless nvmlInit succeeded: NVML and the
//     go-nvml bindings may crash the process when called otherwise. A node
//     without the library, the driver or cgo gets a Monitor that reports
//     ErrNoNVML and calls nothing.
//   - nvmlShutdown is called once, only after a successful Init, and no NVML
//     function is called after it.
//   - A GPU attribute that cannot be read is left unknown (zero); it hides
//     neither the GPU nor its other attributes.
//   - Calls into NVML are serialised by the Monitor.
package nvml

import (
	"errors"
	"fmt"
	"log/slog"
	"sync"
)

var (
	// ErrNoNVML means NVML cannot be used on this node: the library or the
	// driver is missing, Init failed, or the binary was built without cgo.
	// The error wraps the reason. Treat it as "no GPU".
	ErrNoNVML = errors.New("no NVML")
	// ErrClosed means the Monitor was closed.
	ErrClosed = errors.New("nvml monitor closed")
)

// GPU is what NVML reports for one device. Zero means unknown.
type GPU struct {
	Index            int    // NVML device index
	Name             string // e.g. "NVIDIA H200"
	UUID             string // e.g. "GPU-6f0e..."
	MemoryTotalBytes uint64
	MemoryUsedBytes  uint64
	PCIeLinkGen      int // current generation (drops when the GPU idles)
	PCIeLinkWidth    int // current width, in lanes
	PCIeLinkGenMax   int
	PCIeLinkWidthMax int
}

// Inventory is a snapshot of the node's GPUs.
type Inventory struct {
	DriverVersion string
	// Count is the number of GPUs NVML reports (nvmlDeviceGetCount), those
	// whose handle could not be opened (a lost GPU) included; GPUs holds
	// only the ones that opened.
	Count int
	GPUs  []GPU
}

// Config configures Open.
type Config struct {
	// Library is the NVML library to load; "" means libnvidia-ml.so.1.
	Library string
	// Logger logs what the Monitor finds (no NVML, a GPU it cannot
	// read, a scrape that failed); nil means slog.Default().
	Logger *slog.Logger
}

// driver is the part of a Monitor that talks to NVML; it exists only after
// a successful Init.
type driver interface {
	inventory() (Inventory, error)
	shutdown() error
}

// Monitor reads GPU inventory and telemetry. It is safe for concurrent use.
type Monitor struct {
	log    *slog.Logger
	mu     sync.Mutex
	drv    driver // nil when NVML is unavailable or the Monitor is closed
	reason error  // why drv is nil (wraps ErrNoNVML), nil while drv is set
	closed bool
}

// logger is log, or slog.Default() when nil.
func logger(log *slog.Logger) *slog.Logger {
	if log == nil {
		return slog.Default()
	}
	return log
}

func unavailable(reason error, log *slog.Logger) *Monitor {
	log = logger(log)
	log.Info("nvml: no GPU telemetry", "reason", reason)
	return &Monitor{log: log, reason: reason}
}

// logger is the Monitor's logger (a zero Monitor's: slog.Default()).
func (m *Monitor) logger() *slog.Logger { return logger(m.log) }

// Available reports whether NVML initialised.
func (m *Monitor) Available() bool {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.drv != nil
}

// Err is nil when NVML is available, else why not (wrapping ErrNoNVML or
// ErrClosed).
func (m *Monitor) Err() error {
	m.mu.Lock()
	defer m.mu.Unlock()
	switch {
	case m.closed:
		return ErrClosed
	case m.drv == nil:
		return m.noNVML()
	}
	return nil
}

// noNVML is why drv is nil on an open Monitor: reason, or for a zero Monitor
// (never opened, so no reason) a bare ErrNoNVML, so that Err and Inventory
// agree with Available. Called with mu held.
func (m *Monitor) noNVML() error {
	if m.reason == nil {
		return ErrNoNVML
	}
	return m.reason
}

// Inventory reads every GPU now. Without NVML it returns an empty Inventory
// and an error wrapping ErrNoNVML.
func (m *Monitor) Inventory() (Inventory, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	switch {
	case m.closed:
		return Inventory{}, fmt.Errorf("inventory: %w", ErrClosed)
	case m.drv == nil:
		return Inventory{}, fmt.Errorf("inventory: %w", m.noNVML())
	}
	inv, err := m.drv.inventory()
	if err != nil {
		return Inventory{}, fmt.Errorf("inventory: %w", err)
	}
	return inv, nil
}

// Close shuts NVML down if it was initialised. A second Close returns nil.
func (m *Monitor) Close() error {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.closed {
		return nil
	}
	m.closed = true
	drv := m.drv
	m.drv = nil
	if drv == nil {
		return nil
	}
	if err := drv.shutdown(); err != nil {
		return fmt.Errorf("close nvml: %w", err)
	}
	return nil
}
