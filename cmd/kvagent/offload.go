package main

import (
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"math"
	"math/bits"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/urfave/cli/v2"

	"github.com/kvrouter/kvrouter/internal/diskfree"
	"github.com/kvrouter/kvrouter/kvevent"
	"github.com/kvrouter/kvrouter/offload/backend"
	"github.com/kvrouter/kvrouter/offload/engineapi"
	"github.com/kvrouter/kvrouter/offload/manager"
	"github.com/kvrouter/kvrouter/offload/pool"
)

// offloadCLIFlags are the flags of the offload side (docs/offload.md).
func offloadCLIFlags() []cli.Flag {
	return []cli.Flag{
		&cli.StringFlag{Name: "offload-socket", EnvVars: []string{"KVAGENT_OFFLOAD_SOCKET"}, Usage: "Unix socket of the engine offload API (empty: offload off)"},
		&cli.StringFlag{Name: "backend", Value: "auto", EnvVars: []string{"KVAGENT_BACKEND"}, Usage: "copy backend: auto (cuda when a GPU is found), host or cuda"},
		&cli.IntFlag{Name: "cuda-device", Value: 0, EnvVars: []string{"KVAGENT_CUDA_DEVICE"}, Usage: "CUDA device ordinal the cuda backend opens (after CUDA_VISIBLE_DEVICES); every dp rank's G1 is mapped into it, so give the engine's GPU, or one with peer access to each rank's"},
		&cli.IntFlag{Name: "block-bytes", EnvVars: []string{"KVAGENT_BLOCK_BYTES"}, Usage: "bytes per KV block (all layers), as the engine's G1 region holds them; required with --offload-socket"},
		&cli.IntFlag{Name: "host-blocks", EnvVars: []string{"KVAGENT_HOST_BLOCKS"}, Usage: "G2 capacity per dp rank, in blocks of pinned host memory (0: no G2)"},
		&cli.StringFlag{Name: "disk-dir", EnvVars: []string{"KVAGENT_DISK_DIR"}, Usage: "G3 directory; each dp rank's pool lives in <dir>/dp<rank> and survives a restart " +
			"under the same --worker-id, --model, --salt and --block-size (under others, its blocks are dropped at the start)"},
		&cli.IntFlag{Name: "disk-blocks", EnvVars: []string{"KVAGENT_DISK_BLOCKS"}, Usage: "G3 capacity per dp rank, in blocks (0: no G3)"},
		&cli.IntFlag{Name: "offload-workers", Value: 2, EnvVars: []string{"KVAGENT_OFFLOAD_WORKERS"}, Usage: "copy workers per path and rank"},
		&cli.IntFlag{Name: "offload-queue", Value: 4096, EnvVars: []string{"KVAGENT_OFFLOAD_QUEUE"}, Usage: "blocks each offload queue holds before it sheds the lowest priority"},
		&cli.IntFlag{Name: "offload-filter-threshold", Value: 2, EnvVars: []string{"KVAGENT_OFFLOAD_FILTER_THRESHOLD"}, Usage: "times a block must be seen before it is written to disk (1: every block)"},
		&cli.IntFlag{Name: "offload-max-region-blocks", Value: engineapi.DefaultMaxRegionBlocks, EnvVars: []string{"KVAGENT_OFFLOAD_MAX_REGION_BLOCKS"}, Usage: "largest G1 region an engine may register, in blocks (the agent keeps a few dozen bytes per block)"},
		&cli.DurationFlag{Name: "onboard-timeout", Value: time.Second, EnvVars: []string{"KVAGENT_ONBOARD_TIMEOUT"}, Usage: "default deadline of an onboard that gives none"},
	}
}

// offloadConfig is what the offload flags say.
type offloadConfig struct {
	Socket         string
	Backend        backend.Kind
	CUDADevice     int
	BlockBytes     int
	HostBlocks     int
	DiskDir        string
	DiskBlocks     int
	Workers        int
	Queue          int
	Threshold      int
	OnboardTimeout time.Duration
	MaxRegion      int // blocks
	// DiskIdentity is what the G3 pools record of the agent that wrote
	// them (diskIdentity); a pool of another is emptied at open.
	DiskIdentity string
}

func offloadConfigFrom(c *cli.Context) (offloadConfig, error) {
	kind, err := backend.ParseKind(c.String("backend"))
	if err != nil {
		return offloadConfig{}, fmt.Errorf("--backend: %w", err)
	}
	if c.String("offload-socket") == "" {
		// The offload side runs only with its socket: its other flags
		// alone would start an agent without it, and no word.
		for _, f := range offloadCLIFlags() {
			// An empty value (a templated KVAGENT_DISK_DIR=) or the
			// default spelled out (--backend auto) asks for nothing.
			if name := f.Names()[0]; name != "offload-socket" && c.IsSet(name) && !atDefault(c, f) {
				return offloadConfig{}, fmt.Errorf("--%s (or %s) is for the offload side, which runs only with --offload-socket: give --offload-socket, or leave --%s out",
					name, f.(cli.DocGenerationFlag).GetEnvVars()[0], name)
			}
		}
	}
	oc := offloadConfig{Socket: c.String("offload-socket"), Backend: kind, CUDADevice: c.Int("cuda-device"), BlockBytes: c.Int("block-bytes"),
		HostBlocks: c.Int("host-blocks"), DiskDir: c.String("disk-dir"), DiskBlocks: c.Int("disk-blocks"),
		Workers: c.Int("offload-workers"), Queue: c.Int("offload-queue"), Threshold: c.Int("offload-filter-threshold"),
		OnboardTimeout: c.Duration("onboard-timeout"), MaxRegion: c.Int("offload-max-region-blocks"),
		DiskIdentity: diskIdentity(c.Uint64("worker-id"), c.String("model"), c.String("salt"), c.Int("block-size"))}
	return oc, oc.check()
}

// diskIdentity names what a G3 pool's blocks are KV of, as far as the
// agent knows: the worker (its engine), the model, the salt every block
// hash is made with, and the block size in tokens (the pool checks the one
// in bytes itself). A pool reopened under another identity drops its
// blocks: the hashes alone do not tell one model's KV from another's. The
// salt is recorded as a digest: the pool's files need not hold it.
func diskIdentity(worker uint64, model, salt string, blockTokens int) string {
	s := "none"
	if salt != "" {
		sum := sha256.Sum256([]byte(salt))
		s = hex.EncodeToString(sum[:16])
	}
	return fmt.Sprintf("kvagent worker=%d model=%q block_size=%d salt_sha256=%s", worker, model, blockTokens, s)
}

// atDefault reports whether flag f's value is empty or its default.
func atDefault(c *cli.Context, f cli.Flag) bool {
	v := fmt.Sprint(c.Value(f.Names()[0]))
	d := ""
	if dg, ok := f.(cli.DocGenerationFlag); ok {
		d = dg.GetDefaultText()
		if d == "" {
			d = dg.GetValue()
		}
	}
	return v == "" || v == strings.Trim(d, `"`)
}

func (oc offloadConfig) check() error {
	if oc.Socket == "" {
		return nil
	}
	switch {
	case oc.CUDADevice < 0:
		return fmt.Errorf("--cuda-device %d: want a CUDA device ordinal, 0 or more", oc.CUDADevice)
	case oc.BlockBytes <= 0:
		return fmt.Errorf("--block-bytes %d: want the size of one KV block in bytes", oc.BlockBytes)
	case oc.HostBlocks < 0 || oc.HostBlocks > math.MaxInt32:
		return fmt.Errorf("--host-blocks %d: want 0 (no G2) to %d blocks per rank", oc.HostBlocks, math.MaxInt32)
	case oc.DiskBlocks < 0 || oc.DiskBlocks > math.MaxInt32:
		return fmt.Errorf("--disk-blocks %d: want 0 (no G3) to %d blocks per rank", oc.DiskBlocks, math.MaxInt32)
	case oc.HostBlocks == 0 && oc.DiskBlocks == 0:
		return errors.New("--offload-socket needs --host-blocks or --disk-blocks")
	case (oc.DiskBlocks > 0) != (oc.DiskDir != ""):
		return errors.New("--disk-dir and --disk-blocks go together")
	case oc.Workers < 1 || oc.Queue < 1 || oc.Threshold < 1:
		return fmt.Errorf("--offload-workers %d, --offload-queue %d, --offload-filter-threshold %d: want at least 1",
			oc.Workers, oc.Queue, oc.Threshold)
	case oc.Threshold > math.MaxUint32:
		// Each rank's filter counts to 32 bits, and refuses more once
		// the pools are open.
		return fmt.Errorf("--offload-filter-threshold %d: want at most %d", oc.Threshold, uint64(math.MaxUint32))
	case len(oc.Socket) > maxSocketPath:
		return fmt.Errorf("--offload-socket %q: %d bytes, past the %d a Unix socket's path may hold: give a shorter path", oc.Socket, len(oc.Socket), maxSocketPath)
	case oc.OnboardTimeout <= 0:
		return fmt.Errorf("--onboard-timeout %v: want > 0", oc.OnboardTimeout)
	case oc.MaxRegion < 1:
		return fmt.Errorf("--offload-max-region-blocks %d: want at least 1", oc.MaxRegion)
	}
	// The engine API listens on the socket once the pools are open: a
	// directory that is not there fails the start then, with the pools
	// made for nothing.
	if dir := filepath.Dir(oc.Socket); dir != "" {
		if fi, err := os.Stat(dir); err != nil || !fi.IsDir() {
			why := "not a directory"
			if err != nil {
				why = err.Error()
			}
			return fmt.Errorf("--offload-socket %q: its directory %s: want an existing directory (the agent makes the socket, not the directory)", oc.Socket, why)
		}
	}
	return nil
}

// maxSocketPath is the longest path a Unix socket may have (sun_path,
// less its terminating NUL: 107 bytes on Linux).
var maxSocketPath = len(syscall.RawSockaddrUnix{}.Path) - 1

// offloadSink is what the pools publish through, what republishes a
// reopened G3 pool, and what checks each offload request against the
// engine's own events: *agent.Agent.
type offloadSink interface {
	pool.Sink
	engineapi.Checker
	Restore(r kvevent.Rank, stored []kvevent.Event) error
}

// offload is the agent's offload side: the backend, each rank's pools and
// the engine API. Managers are started by the engine API when the engine
// registers its G1 region.
type offload struct {
	be    backend.Backend
	hosts []*pool.HostPool
	disks []*pool.DiskPool
	srv   *engineapi.Server
}

// openBackend opens the offload backend; a test replaces it to see the
// device startOffload asks for (the real one loads libcuda.so.1).
var openBackend = backend.OpenDevice

// startOffload opens the backend, each rank's pools (a G3 pool reopened
// with blocks gives them to sink.Restore, so the rank's first dump carries
// them) and the engine API. Call it before the agent runs.
func startOffload(oc offloadConfig, ranks []kvevent.Rank, sink offloadSink, reg prometheus.Registerer, log *slog.Logger) (_ *offload, err error) {
	o := &offload{}
	defer func() {
		if err != nil {
			o.Close()
		}
	}()
	be, err := openBackend(oc.Backend, oc.CUDADevice, log)
	if err != nil {
		if errors.Is(err, backend.ErrNoCUDA) {
			return nil, fmt.Errorf("open the %s backend: %w (give --backend host, or auto, on a machine without a GPU)", oc.Backend, err)
		}
		return nil, fmt.Errorf("open the %s backend: %w", oc.Backend, err)
	}
	o.be = be // only on success: Close closes it
	var rps []engineapi.RankPools
	var diskDirs []string // o.disks[i]'s directory
	for _, r := range ranks {
		rp := engineapi.RankPools{Rank: r}
		pc := pool.Config{Rank: r, BlockSize: oc.BlockBytes, Sink: sink, Registerer: reg, Logger: log}
		if oc.HostBlocks > 0 {
			pc.Capacity = oc.HostBlocks
			if rp.Host, err = pool.NewHost(o.be, pc); err != nil {
				return nil, fmt.Errorf("rank %s: %w", r, err)
			}
			o.hosts = append(o.hosts, rp.Host)
		}
		if oc.DiskBlocks > 0 {
			dir := filepath.Join(oc.DiskDir, "dp"+strconv.FormatUint(uint64(r.DP), 10))
			if err := os.MkdirAll(dir, 0o700); err != nil {
				return nil, fmt.Errorf("rank %s: %w", r, err)
			}
			pc.Capacity = oc.DiskBlocks
			if rp.Disk, err = pool.OpenDisk(dir, pc, pool.DiskOptions{Identity: oc.DiskIdentity}); err != nil {
				if lockedByAnother(err) {
					return nil, fmt.Errorf("rank %s: %s is locked by another process: another kvagent using --disk-dir %s? (give each agent a --disk-dir of its own): %w",
						r, dir, oc.DiskDir, err)
				}
				return nil, fmt.Errorf("rank %s: %w", r, err)
			}
			o.disks = append(o.disks, rp.Disk)
			diskDirs = append(diskDirs, dir)
			// Under the pool's lock: a shutdown for damage right after the
			// open publishes its REMOVEs after the restore, not before it
			// (the blocks would then stay advertised).
			restored := 0
			if err := rp.Disk.DumpTo(func(evs []kvevent.Event) error {
				if len(evs) == 0 {
					return nil
				}
				for _, ev := range evs {
					restored += len(ev.Blocks)
				}
				return sink.Restore(r, evs)
			}); err != nil {
				return nil, fmt.Errorf("rank %s: republish the disk pool: %w", r, err)
			}
			if restored > 0 {
				log.Info("disk pool reopened", "rank", r, "dir", dir, "blocks", restored)
			}
		}
		rps = append(rps, rp)
	}
	if oc.DiskBlocks > 0 {
		pools := make([]diskPool, len(o.disks))
		for i, d := range o.disks {
			pools[i] = diskPool{Dir: diskDirs[i], Held: mulSat(uint64(d.Stats().Used), uint64(oc.BlockBytes))}
		}
		warnIfDiskTierExceedsFreeSpace(oc, pools, diskfree.RoomOf, log)
	}
	o.srv, err = engineapi.Listen(engineapi.Config{Socket: oc.Socket, Backend: o.be, Ranks: rps, Checker: sink,
		MaxRegionBlocks: oc.MaxRegion,
		Manager: manager.Config{QueueCapacity: oc.Queue, Workers: oc.Workers, OnboardTimeout: oc.OnboardTimeout,
			Filter: manager.FilterConfig{Threshold: oc.Threshold}},
		Registerer: reg, Logger: log})
	if err != nil {
		return nil, err
	}
	return o, nil
}

// A diskPool is one rank's G3 pool as the free-space check sees it: its
// directory, and the bytes its blocks hold already.
type diskPool struct {
	Dir  string
	Held uint64
}

// warnIfDiskTierExceedsFreeSpace logs a warning, once per file system,
// when the disk tier's pools on that file system (--disk-blocks ×
// --block-bytes each) need more bytes than it has free plus what those
// pools hold already. The pools live in <--disk-dir>/dp<rank>, but a
// rank's directory may be a mount point or a symbolic link to another
// disk (one disk per rank): each file system is checked for the pools it
// holds, found by room's Device, so a disk that holds two ranks' pools
// must have room for both, and one that holds none is not asked. Such a
// tier fills the disk: G3's writes then fail while Pebble retries a flush
// that cannot succeed, until the operator makes room, and the disk is
// full for everything else on it too. It only warns: the free space may
// be shared, and change. A room it cannot read is logged at Debug and
// that directory's pool skipped.
func warnIfDiskTierExceedsFreeSpace(oc offloadConfig, pools []diskPool, room func(string) (diskfree.Room, error), log *slog.Logger) {
	type fileSystem struct {
		avail, held uint64
		dirs        []string
	}
	var order []uint64 // devices in rank order: the warnings are too
	fss := make(map[uint64]*fileSystem)
	for _, p := range pools {
		r, err := room(p.Dir)
		if err != nil {
			log.Debug("free space of a disk pool's directory unknown: not checked against the disk tier", "dir", p.Dir, "err", err)
			continue
		}
		fs := fss[r.Device]
		if fs == nil {
			fs = &fileSystem{avail: r.Available}
			fss[r.Device] = fs
			order = append(order, r.Device)
		}
		fs.held = addSat(fs.held, p.Held)
		fs.dirs = append(fs.dirs, p.Dir)
	}
	for _, dev := range order {
		fs := fss[dev]
		ranks := uint64(len(fs.dirs))
		// Each factor fits a uint64 but the product need not: --dp-size
		// takes up to 4096 ranks, each pool's bytes up to MaxInt, and a
		// product wrapped past 2^64 reads as a small tier that fits.
		// Saturated, a tier of 2^64 bytes or more is larger than any
		// free space.
		want := mulSat(mulSat(uint64(oc.DiskBlocks), uint64(oc.BlockBytes)), ranks)
		have := addSat(fs.avail, fs.held)
		if want <= have {
			continue
		}
		var tierBytes any = want
		if want == math.MaxUint64 {
			tierBytes = "2^64 or more"
		}
		fit := have / uint64(oc.BlockBytes) / ranks
		log.Warn("offload: the disk tier (G3) is larger than the free space of its file system: it will fill the disk, and "+
			"writes to G3 then fail until there is room; lower --disk-blocks or free space",
			"dirs", strings.Join(fs.dirs, " "), "tier_bytes", tierBytes, "free_bytes", fs.avail, "held_bytes", fs.held,
			"ranks", ranks, "disk_blocks", oc.DiskBlocks, "block_bytes", oc.BlockBytes, "disk_blocks_that_fit", fit)
	}
}

// mulSat returns a×b, or math.MaxUint64 where the product overflows.
func mulSat(a, b uint64) uint64 {
	hi, lo := bits.Mul64(a, b)
	if hi != 0 {
		return math.MaxUint64
	}
	return lo
}

// addSat returns a+b, or math.MaxUint64 where the sum overflows.
func addSat(a, b uint64) uint64 {
	sum, carry := bits.Add64(a, b, 0)
	if carry != 0 {
		return math.MaxUint64
	}
	return sum
}

// lockedByAnother reports whether err, from opening a disk pool, is its
// database's lock held by another process: Pebble's lock is an fcntl
// lock on <dir>/LOCK, which fails with EAGAIN (or, by POSIX, EACCES) when
// another process holds it. An EACCES from opening the file is a
// *fs.PathError: a permission problem, not a lock.
func lockedByAnother(err error) bool {
	var pe *fs.PathError
	return errors.Is(err, syscall.EAGAIN) || errors.Is(err, syscall.EACCES) && !errors.As(err, &pe)
}

// Close stops the offload side in order: the engine API (its Managers
// finish their copies in flight, the G1 mappings go), the pools, the
// backend.
func (o *offload) Close() error {
	var errs []error
	if o.srv != nil {
		errs = append(errs, o.srv.Close())
	}
	for _, p := range o.hosts {
		errs = append(errs, p.Close())
	}
	for _, p := range o.disks {
		errs = append(errs, p.Close())
	}
	if o.be != nil {
		errs = append(errs, o.be.Close())
	}
	return errors.Join(errs...)
}
