package main

import (
	"bufio"
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"maps"
	"net/http/httptrace"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvrouter/kvrouter/api"
	"github.com/kvrouter/kvrouter/api/client"
	"github.com/kvrouter/kvrouter/raftfsm"
	"github.com/schollz/progressbar/v3"
	"github.com/urfave/cli/v2"
)

func snapshotCommand(e *env) *cli.Command {
	maxTime := &cli.DurationFlag{Name: "max-time", Usage: "give up after `DURATION`", DefaultText: "no limit; Ctrl-C stops"}
	return &cli.Command{
		Name:  "snapshot",
		Usage: "save, inspect or restore a snapshot of the cluster's state",
		Description: "Example:\n" +
			"   kvctl snapshot save backup.snap\n" +
			"   kvctl snapshot inspect backup.snap\n" +
			"   kvctl snapshot restore backup.snap",
		Action: group("save, inspect or restore"),
		Subcommands: []*cli.Command{
			{
				Name:      "save",
				Usage:     "stream the leader's latest state into FILE, or save a stopped node's data directory",
				ArgsUsage: "FILE",
				Description: "The stream goes to a temporary file of its own beside FILE (FILE.RANDOM.part),\n" +
					"which is synced, verified (header, counts and checksum) and only then renamed to\n" +
					"FILE: FILE is never half-written. An existing FILE is replaced without asking (of\n" +
					"two saves to one FILE at once, the last to finish is kept); a FILE that is a\n" +
					"directory is refused before the leader is asked (exit 2). A spinner with the\n" +
					"bytes received shows on a terminal (the size is not known in advance). --timeout\n" +
					"does not bound the transfer; --max-time does.\n\n" +
					"Offline (--data-dir): no node is asked. The state is read from a stopped node's data\n" +
					"directory (refused while a node runs on it), for a cluster that lost its majority\n" +
					"for good: the state, brought to the newest Raft snapshot as a start brings it, and\n" +
					"then every entry of the node's Raft log after it, committed or not (offline there is\n" +
					"no commit index; --applied-only leaves them out). The directory is not changed: its\n" +
					"state and log are copied into a temporary directory beside FILE, removed at the end\n" +
					"(as much free space as the directory's fsm/ and raft/). Seed the new cluster from\n" +
					"FILE (kvctl snapshot restore FILE --data-dir ...).\n\n" +
					"Example:\n   kvctl snapshot save /backups/kvrouter-$(date +%F).snap\n" +
					"   kvctl snapshot save /backups/survivor.snap --data-dir /var/lib/kvrouter",
				Flags: []cli.Flag{
					maxTime,
					// No environment variable, as for restore's: which mode
					// runs must show on the command line.
					&cli.StringFlag{Name: "data-dir", Usage: "offline: save the stopped node's data `DIR` instead of asking the leader"},
					&cli.BoolFlag{Name: "applied-only", Usage: "offline: save the state as the node applied it, without the entries of its Raft log after it"},
				},
				Action: func(c *cli.Context) error {
					if err := fileArg(c); err != nil {
						return err
					}
					// The flag given chooses the mode, not its value: a
					// --data-dir "$DIR" whose variable is unset must not
					// fall back to asking the cluster.
					if c.IsSet("data-dir") {
						return snapshotSaveDir(c, e, c.Args().First())
					}
					if c.IsSet("applied-only") {
						return usagef("--applied-only is for the offline save: give --data-dir DIR too")
					}
					return snapshotSave(c, e, c.Args().First())
				},
			},
			{
				Name:      "inspect",
				Usage:     "offline: show what FILE holds and check its checksum",
				ArgsUsage: "FILE",
				Description: "Reads the file only; no node is asked.\n\n" +
					"Example:\n   kvctl snapshot inspect backup.snap",
				Action: func(c *cli.Context) error {
					if err := fileArg(c); err != nil {
						return err
					}
					path := c.Args().First()
					info, err := inspectFile(c.Context, e, path)
					if err != nil {
						return err
					}
					return printSnapshotInfo(c, e, path, info)
				},
			},
			{
				Name:      "restore",
				Usage:     "install FILE on the running cluster, or seed a new node's data directory with it",
				ArgsUsage: "FILE",
				Description: "Online (no --data-dir): the file is verified here, uploaded to the first node that\n" +
					"answers a readiness probe (never to one that did not; none: nothing is sent) and\n" +
					"installed through Raft on every node; it replaces the whole state of the cluster. A\n" +
					"damaged file is refused and the cluster keeps its state, as it does when the node\n" +
					"reads none of the upload for --timeout. Once the\n" +
					"upload went out whole, kvctl waits for the answer at most a minute plus a second per\n" +
					"MiB of the file, and the cluster goes on with it even if kvctl stops waiting (that\n" +
					"bound, --max-time, Ctrl-C): kvctl then says the outcome is unknown; see kvctl status\n" +
					"before restoring again.\n\n" +
					"Offline (--data-dir, --node-id, --peers): the file is written into a new node's\n" +
					"data directory, one that holds no node state (no fsm/, raft/ or Raft snapshots;\n" +
					"files that are not a node's, such as lost+found, are left alone). Seed every node\n" +
					"of the new cluster from the same file, then start each with the same --peers.\n\n" +
					"Example:\n" +
					"   kvctl snapshot restore backup.snap\n" +
					"   kvctl snapshot restore backup.snap --data-dir /var/lib/kvrouter --node-id n1 \\\n" +
					"      --peers n1=10.0.0.1:7000=10.0.0.1:7080,n2=10.0.0.2:7000=10.0.0.2:7080,n3=10.0.0.3:7000=10.0.0.3:7080",
				Flags: []cli.Flag{
					maxTime,
					// No environment variable: which mode runs must show on
					// the command line (KVROUTER_DATA_DIR is the daemon's).
					&cli.StringFlag{Name: "data-dir", Usage: "offline: seed this new node's data `DIR` instead of restoring online"},
					&cli.StringFlag{Name: "node-id", Usage: "offline: the `ID` of the node that will own --data-dir"},
					&cli.StringFlag{Name: "peers", Usage: "offline: every node of the new cluster as `id=raftaddr=httpaddr`,... (checked as kvrouter --peers is: each raftaddr one peers dial, not a wildcard)"},
				},
				Action: func(c *cli.Context) error {
					if err := fileArg(c); err != nil {
						return err
					}
					// The flags given choose the mode, not their values: a
					// --data-dir "$DIR" whose variable is unset must not
					// fall back to replacing the running cluster's state.
					if c.IsSet("data-dir") {
						return snapshotSeed(c, e, c.Args().First())
					}
					if c.IsSet("node-id") || c.IsSet("peers") {
						return usagef("--node-id and --peers seed a data directory: give --data-dir DIR too (or neither, to restore online)")
					}
					return snapshotRestore(c, e, c.Args().First())
				},
			},
		},
	}
}

// fileArg checks that the command got one FILE, a path: a snapshot is
// written through a temporary file beside it, synced and verified before it is renamed,
// and read twice on restore (checked, then sent), none of which a pipe
// allows, so "-" is refused rather than taken as a file name.
func fileArg(c *cli.Context) error {
	if err := args(c, 1, "FILE"); err != nil {
		return err
	}
	if c.Args().First() == "-" {
		return usagef("%s FILE: a snapshot file must be a path (- for stdin or stdout is not supported)", helpName(c))
	}
	if d := c.Duration("max-time"); c.IsSet("max-time") && d <= 0 {
		return usagef("--max-time %v: want a positive duration, or leave it out (no limit)", d)
	}
	return nil
}

// snapshotCtx bounds a snapshot transfer by --max-time only.
func snapshotCtx(c *cli.Context) (context.Context, context.CancelFunc) {
	if d := c.Duration("max-time"); d > 0 {
		return context.WithTimeout(c.Context, d)
	}
	return context.WithCancel(c.Context)
}

// maxTimeError is a snapshot transfer cut off by --max-time (not by
// --timeout, which does not bound it).
type maxTimeError struct {
	err error
	max time.Duration
}

func (e *maxTimeError) Error() string { return e.err.Error() }
func (e *maxTimeError) Unwrap() error { return e.err }

// transferErr wraps err as a maxTimeError when --max-time ended ctx.
func transferErr(c *cli.Context, ctx context.Context, err error) error {
	if d := c.Duration("max-time"); d > 0 && errors.Is(ctx.Err(), context.DeadlineExceeded) {
		return &maxTimeError{err: err, max: d}
	}
	return err
}

// snapshotSave streams the snapshot into a temporary file beside path
// (path's name, a random part, .part), syncs it, verifies it by reading it
// back, and renames it to path, replacing whatever path held; on any
// failure that file is removed and path is untouched.
//
// The temporary file is this save's own (os.CreateTemp: O_EXCL, a name
// no other save picks): two saves to the same path at once (overlapping
// cron jobs, a retry from another shell) each write and verify their own,
// and the last to finish renames its whole file over the other's. With a
// shared path+".part" the first one renamed it to path and the other then
// wrote on through its descriptor into the file reported saved.
func snapshotSave(c *cli.Context, e *env, path string) (err error) {
	if err := saveTarget(c, path); err != nil {
		return err
	}
	// The stream may take long (--max-time bounds it); its first bytes
	// come within --timeout from a node that answers at all.
	cl, err := newClientWith(c, endpointsArg(c), attemptTimeout(c), c.Duration("timeout"))
	if err != nil {
		return err
	}
	defer cl.Close()
	ctx, cancel := snapshotCtx(c)
	defer cancel()

	var res client.SnapshotResult
	info, err := saveThroughPart(c, e, path, func(f *os.File) error {
		var w io.Writer = f
		bar := e.progress(c, -1, "saving snapshot")
		if bar != nil {
			w = io.MultiWriter(f, bar)
		}
		var err error
		res, err = cl.SaveSnapshot(ctx, w)
		finishBar(bar)
		if err != nil {
			// A stream the node's shutdown cut off: the next leader (or
			// the node, restarted) answers the save sent again.
			return transferErr(c, ctx, withReasonHint(fmt.Errorf("snapshot save: %w; nothing was saved", err), api.ReasonShuttingDown,
				"the node is stopping: retry the save, which another node in --endpoints answers (or this one once it restarts)"))
		}
		return nil
	}, func(info raftfsm.SnapshotInfo, err error) error {
		if err != nil {
			return fmt.Errorf("the snapshot from %s does not verify: %w; nothing was saved, retry", hostOf(res.Endpoint), err)
		}
		// The server's trailers, where it sent them, must describe the
		// same stream that the file holds.
		srv := res.Info
		if (srv.Index != 0 && srv.Index != info.Index) || (srv.Term != 0 && srv.Term != info.Term) ||
			(srv.SHA256 != "" && info.SHA256 != "" && srv.SHA256 != info.SHA256) {
			return fmt.Errorf("the snapshot from %s is not the one announced (index %d term %d sha256 %s, file has index %d term %d sha256 %s); nothing was saved, retry",
				hostOf(res.Endpoint), srv.Index, srv.Term, srv.SHA256, info.Index, info.Term, info.SHA256)
		}
		return nil
	})
	if err != nil {
		return err
	}
	sum := info.SHA256
	if sum == "" {
		sum = res.SHA256
	}
	if jsonOut(c) {
		return writeJSON(e.stdout, snapshotReport{File: path, SnapshotInfo: info, Bytes: res.Bytes, SHA256: sum, ChecksumOK: true})
	}
	_, err = fmt.Fprintf(e.stdout, "saved %s (index %d, term %d, %s, sha256 %s)\n", path, info.Index, info.Term, size(res.Bytes), sum)
	return err
}

// snapshotSaveDir saves a stopped node's data directory into path
// (raftfsm.SaveDataDir), through a temporary file beside it as the online
// save does: synced, verified and renamed, path untouched on a failure.
func snapshotSaveDir(c *cli.Context, e *env, path string) (err error) {
	dir := c.String("data-dir")
	if dir == "" {
		return usagef("--data-dir is empty: give the stopped node's data directory (or leave --data-dir out, to save from the leader)")
	}
	if err := saveTarget(c, path); err != nil {
		return err
	}
	// FILE, its .part and the working copy beside it would be written
	// into DIR, which the save leaves as it was.
	if err := raftfsm.OutsideDataDir(dir, path); errors.Is(err, raftfsm.ErrInvalid) {
		return usagef("FILE %s is inside --data-dir %s: the save leaves the data directory as it was; give a FILE outside it", path, dir)
	} else if err != nil {
		// The error names the path that failed to resolve, FILE's (a
		// parent that is a regular file) or DIR's.
		return fmt.Errorf("snapshot save --data-dir %s: %w; nothing was saved", dir, err)
	}
	ctx, cancel := snapshotCtx(c)
	defer cancel()
	var rep raftfsm.SaveReport
	info, err := saveThroughPart(c, e, path, func(f *os.File) error {
		w := bufio.NewWriterSize(f, 1<<20)
		var err error
		rep, err = raftfsm.SaveDataDir(ctx, dir, w, raftfsm.SaveOptions{AppliedOnly: c.Bool("applied-only"), TempDir: filepath.Dir(path)})
		if err == nil {
			err = w.Flush()
		}
		if err != nil {
			return transferErr(c, ctx, fmt.Errorf("snapshot save --data-dir %s: %w; nothing was saved", dir, err))
		}
		return nil
	}, func(info raftfsm.SnapshotInfo, err error) error {
		if err != nil {
			return fmt.Errorf("the snapshot of %s does not verify: %w; nothing was saved", dir, err)
		}
		if info.SHA256 != "" && info.SHA256 != rep.Snapshot.SHA256 {
			return fmt.Errorf("the snapshot of %s is not the one written (sha256 %s, file has %s); nothing was saved", dir, rep.Snapshot.SHA256, info.SHA256)
		}
		return nil
	})
	if err != nil {
		return err
	}
	if jsonOut(c) {
		return writeJSON(e.stdout, offlineSaveReport{
			snapshotReport: snapshotReport{File: path, SnapshotInfo: info, Bytes: rep.Snapshot.Bytes, SHA256: rep.Snapshot.SHA256, ChecksumOK: true},
			DataDir:        dir, AppliedOnly: c.Bool("applied-only"), AppliedIndex: rep.AppliedIndex, AppliedTerm: rep.AppliedTerm,
			LogLastIndex: rep.LogLastIndex, LogLastTerm: rep.LogLastTerm, LogEntriesApplied: rep.LogEntries, LogEntriesLeft: rep.LogEntriesLeft,
			LogEntriesDetached: rep.LogEntriesDetached})
	}
	if _, err := fmt.Fprintf(e.stdout, "saved %s from %s (index %d, term %d, %s, sha256 %s)\n",
		path, dir, info.Index, info.Term, size(rep.Snapshot.Bytes), rep.Snapshot.SHA256); err != nil {
		return err
	}
	// The log's last index and term are what ranks survivors (Majority
	// lost, step 3: Raft's election rule), not the file's.
	_, err = fmt.Fprintf(e.stdout, "state applied at index %d (term %d); Raft log last index %d (term %d)\n",
		rep.AppliedIndex, rep.AppliedTerm, rep.LogLastIndex, rep.LogLastTerm)
	switch {
	case err != nil:
	case rep.LogEntries > 0:
		_, err = fmt.Fprintf(e.stdout, "applied the log's %d entries after index %d: some may never have been committed (their clients saw no acknowledgement, or an unknown outcome); --applied-only leaves them out\n",
			rep.LogEntries, rep.AppliedIndex)
	case rep.LogEntriesLeft > 0:
		_, err = fmt.Fprintf(e.stdout, "left out the log's %d entries after index %d (--applied-only): acknowledged writes among them are not in %s\n",
			rep.LogEntriesLeft, rep.AppliedIndex, path)
	case rep.LogEntriesDetached == 0:
		_, err = fmt.Fprintf(e.stdout, "the log holds no entry after index %d\n", rep.AppliedIndex)
	}
	if err == nil && rep.LogEntriesDetached > 0 {
		_, err = fmt.Fprintf(e.stdout, "left out the log's %d entries after index %d: they do not continue the newest Raft snapshot (another history, which a node's start never applies)\n",
			rep.LogEntriesDetached, rep.LogLastIndex-rep.LogEntriesDetached)
	}
	return err
}

// offlineSaveReport is the JSON of an offline save: the file's, and what
// was read from the data directory.
type offlineSaveReport struct {
	snapshotReport
	DataDir           string `json:"data_dir"`
	AppliedOnly       bool   `json:"applied_only"`
	AppliedIndex      uint64 `json:"applied_index"`
	AppliedTerm       uint64 `json:"applied_term"`
	LogLastIndex      uint64 `json:"log_last_index"`
	LogLastTerm       uint64 `json:"log_last_term"`
	LogEntriesApplied uint64 `json:"log_entries_applied"`
	LogEntriesLeft    uint64 `json:"log_entries_left"`
	// Entries that do not continue the newest Raft snapshot: another
	// history, never applied (raftfsm.SaveReport.LogEntriesDetached).
	LogEntriesDetached uint64 `json:"log_entries_detached"`
}

// saveThroughPart writes a snapshot file at path through a temporary
// file of its own beside it (os.CreateTemp: O_EXCL, a name no other save
// picks): write fills it, and it is synced, closed and verified
// (inspectFile), verify judging the result (the inspection's error
// included), before it is renamed over path and the directory synced. On
// any failure the temporary file is removed and path is left as it was.
// Both saves, from the leader and of a data directory, go through it.
func saveThroughPart(c *cli.Context, e *env, path string, write func(*os.File) error,
	verify func(raftfsm.SnapshotInfo, error) error) (info raftfsm.SnapshotInfo, err error) {
	f, err := os.CreateTemp(filepath.Dir(path), filepath.Base(path)+".*.part")
	if err != nil {
		return info, fmt.Errorf("create a temporary file beside %s: %w", path, err)
	}
	part := f.Name()
	closed := false
	defer func() {
		if !closed {
			f.Close()
		}
		if err != nil {
			os.Remove(part)
		}
	}()
	if err := write(f); err != nil {
		return info, err
	}
	if err := f.Sync(); err != nil {
		return info, fmt.Errorf("sync %s: %w", part, err)
	}
	closed = true
	if err := f.Close(); err != nil {
		return info, fmt.Errorf("close %s: %w", part, err)
	}
	info, ierr := inspectFile(c.Context, e, part)
	if err := verify(info, ierr); err != nil {
		return info, err
	}
	if err := os.Rename(part, path); err != nil {
		return info, fmt.Errorf("rename %s to %s: %w", part, path, err)
	}
	if err := syncDir(filepath.Dir(path)); err != nil {
		return info, fmt.Errorf("sync the directory of %s: %w", path, err)
	}
	return info, nil
}

// saveTarget refuses, as a usage error, a FILE that is a directory
// (dir or dir/, a link to one): the verified file could never be renamed
// over it, and the refusal comes before the leader is asked, where the
// rename failed with "file exists" after the whole state had streamed.
// So is a FILE that is there and is not a regular file (a FIFO, a socket,
// a device, or a link to one): the rename would replace it with the
// snapshot, a reader on the FIFO never served and, run as root, a device
// node such as /dev/null gone for a regular file, and kvctl exited 0.
// A FILE that is not there yet, or a regular file, is left to the save:
// an existing file is replaced.
func saveTarget(c *cli.Context, path string) error {
	fi, err := os.Stat(path)
	switch {
	case err != nil || fi.Mode().IsRegular():
		return nil
	case fi.IsDir():
		return usagef("%s %s: FILE is a directory: give the path of a file to save to, such as %s",
			helpName(c), path, filepath.Join(path, "kvrouter.snap"))
	}
	return usagef("%s %s: FILE is a %s, which the save would replace with a regular file: give the path of a regular file to save to (or of none yet)",
		helpName(c), path, fileKind(fi.Mode()))
}

// snapshotReport is the JSON of a snapshot file.
type snapshotReport struct {
	File string `json:"file"`
	raftfsm.SnapshotInfo
	Bytes      int64  `json:"bytes"`  // the file's size
	SHA256     string `json:"sha256"` // as the snapshot's checksum states it
	ChecksumOK bool   `json:"checksum_ok"`
}

func syncDir(dir string) error {
	d, err := os.Open(dir)
	if err != nil {
		return err
	}
	defer d.Close()
	return d.Sync()
}

// inspectFile verifies a snapshot file with the node's own reader; the
// open and the read stop once ctx ends (an interrupt), failing with
// ctx's error, a FIFO's too (openLocal).
func inspectFile(ctx context.Context, e *env, path string) (raftfsm.SnapshotInfo, error) {
	f, done, err := openLocal(ctx, path)
	if err != nil {
		return raftfsm.SnapshotInfo{}, err
	}
	defer done()
	info, err := e.inspect(bufio.NewReaderSize(raftfsm.ContextReader(ctx, f), 1<<20))
	if err != nil {
		return info, fmt.Errorf("%s: %w", path, err)
	}
	return info, nil
}

func printSnapshotInfo(c *cli.Context, e *env, path string, info raftfsm.SnapshotInfo) error {
	// The bytes the reader read and verified: a stat of the path after the
	// read says 0 for a stream (a FIFO, <(zcat f.gz)). The stat is only for
	// a reader that does not count.
	bytes := info.Bytes
	if bytes == 0 {
		if fi, err := os.Stat(path); err == nil && fi.Mode().IsRegular() {
			bytes = fi.Size()
		}
	}
	if jsonOut(c) {
		return writeJSON(e.stdout, snapshotReport{File: path, SnapshotInfo: info, Bytes: bytes, SHA256: info.SHA256, ChecksumOK: true})
	}
	t := newTable(e.stdout)
	t.row("file", path)
	t.row("format version", fmt.Sprint(info.FormatVersion))
	t.row("index", u64(info.Index))
	t.row("term", u64(info.Term))
	t.row("size", fmt.Sprintf("%s (%d bytes)", size(bytes), bytes))
	for _, k := range slices.Sorted(maps.Keys(info.Records)) {
		t.row("records "+k, i64(info.Records[k]))
	}
	t.row("sha256", orDash(info.SHA256))
	t.row("checksum", "OK")
	return t.flush()
}

// regularFile refuses, as a usage error, a snapshot file that is not a
// regular file (a FIFO, a process substitution such as <(zcat f.gz), a
// device): a restore reads the file twice (it verifies it, then uploads
// or seeds it, and rewinds it to retry an upload on another node), and a
// stream gives its bytes only once; the second read would wait on a
// producer that has finished. Stat does not open the file: a FIFO with
// no producer is refused at once.
func regularFile(c *cli.Context, path string) error {
	fi, err := os.Stat(path)
	if err != nil {
		return nil // the open that comes next says why, as for inspect
	}
	if !fi.Mode().IsRegular() {
		return usagef("%s %s: a snapshot to restore must be a regular file, not a %s: kvctl reads it twice (it verifies it first); save the stream to a file, then restore that",
			helpName(c), path, fileKind(fi.Mode()))
	}
	return nil
}

// fileKind names a mode's file type for regularFile's refusal.
func fileKind(m os.FileMode) string {
	switch {
	case m.IsDir():
		return "directory"
	case m&os.ModeNamedPipe != 0:
		return "FIFO (a named pipe or a process substitution)"
	case m&os.ModeSocket != 0:
		return "socket"
	case m&os.ModeDevice != 0:
		return "device"
	}
	return "special file"
}

// snapshotRestore verifies the file here, then uploads it to the cluster.
func snapshotRestore(c *cli.Context, e *env, path string) error {
	if err := regularFile(c, path); err != nil {
		return err
	}
	if _, err := inspectFile(c.Context, e, path); err != nil {
		return fmt.Errorf("%w; nothing was sent to the cluster", err)
	}
	f, done, err := openLocal(c.Context, path)
	if err != nil {
		return err
	}
	defer done()
	fi, err := f.Stat()
	if err != nil {
		return err
	}
	// The answer comes only once the cluster has installed the snapshot,
	// which may take long, and a node that never reads the upload stalls
	// it for good: so the upload goes only to nodes that answer, and to
	// none when none does.
	eps, err := answering(c)
	if err != nil {
		return err
	}
	cl, err := newClientWith(c, eps, attemptTimeout(c), restoreAnswerWait(fi.Size()))
	if err != nil {
		return err
	}
	defer cl.Close()
	ctx, cancel := snapshotCtx(c)
	defer cancel()
	// A node that answered the probe may still read none of the upload
	// (its restore wedged, or its forward to a wedged leader): once the
	// connection's buffers are full the upload's write blocks, where the
	// bound on the answer's wait does not apply yet. --timeout without a
	// byte read ends it; nothing was installed, as a node takes an upload
	// only whole.
	stall := c.Duration("timeout")
	ctx, stop := context.WithCancelCause(ctx)
	defer stop(nil)
	up := &uploadFile{File: f, size: fi.Size(), bar: e.progress(c, fi.Size(), "uploading snapshot"),
		stall: time.AfterFunc(stall, func() { stop(errUploadStalled) }), stallAfter: stall}
	up.stall.Stop() // armed by the first read
	defer up.stall.Stop()
	info, err := cl.RestoreSnapshot(up.traced(ctx), up)
	finishBar(up.bar)
	if err != nil {
		if err := up.stalledErr(ctx); err != nil {
			return err
		}
		return transferErr(c, ctx, withTooLargeHint(fmt.Errorf("snapshot restore: %w", err),
			"nothing was installed: raise the node's --max-snapshot-bytes (0: no limit) to take this file, then retry"))
	}
	if jsonOut(c) {
		return writeJSON(e.stdout, snapshotReport{File: path, SnapshotInfo: info, Bytes: fi.Size(), SHA256: info.SHA256, ChecksumOK: true})
	}
	_, err = fmt.Fprintf(e.stdout, "restored %s to the cluster (index %d, term %d, %s)\n", path, info.Index, info.Term, size(fi.Size()))
	return err
}

// errUploadStalled ends an online restore whose node reads none of the
// upload for --timeout.
var errUploadStalled = errors.New("stopped reading the upload")

// restoreAnswerWait bounds the wait for a restore's answer once its upload
// went out whole: the node checks the file and the cluster installs it
// before the answer comes, which takes longer the larger the file. A
// minute, and a second more per MiB of the file: far longer than an
// install takes, but a node that took the upload and never answers does
// not hold kvctl for ever. Past it the outcome is unknown (the cluster may
// still install it).
func restoreAnswerWait(size int64) time.Duration {
	return time.Minute + time.Duration(size>>20)*time.Second
}

// answering probes every endpoint of --endpoints at once for readiness
// and returns, as soon as one answers (ready or not), in their order
// those that have answered by then: the restore starts at the first
// answer, and a hung node's probe, which would run for all of
// attemptTimeout, holds it no longer (the probes still out are ended).
// When none answers within attemptTimeout it returns an error wrapping
// client.ErrUnreachable: the upload then goes nowhere. The restore's
// client knows only those that answered: when the first refuses the
// upload (no leader, stopping) the client tries the next, and one that
// failed the probe, or had not answered it yet, could be hung: it would
// take the upload into its buffers and hold kvctl for the answer's wait,
// to end in an outcome unknown though no node had read it. A follower
// that answered stays: it forwards the upload to its leader. The error
// also wraps the first certificate refusal among the probes' errors, as
// the client's own errors do, so that explain gives the advice other
// commands give (client.CertificateHint).
func answering(c *cli.Context) ([]string, error) {
	// --endpoints is checked whole first, as every command checks it; a
	// blank entry (a trailing comma) is none, as for the client.
	all, err := newClientWith(c, endpointsArg(c), attemptTimeout(c), attemptTimeout(c))
	if err != nil {
		return nil, err
	}
	all.Close()
	var eps []string
	var clients []*client.Client
	defer func() {
		for _, cl := range clients {
			cl.Close()
		}
	}()
	for _, ep := range endpointsArg(c) {
		if strings.TrimSpace(ep) == "" {
			continue
		}
		cl, err := newClientWith(c, []string{ep}, attemptTimeout(c), attemptTimeout(c))
		if err != nil {
			return nil, err
		}
		eps, clients = append(eps, ep), append(clients, cl)
	}
	type probe struct {
		i   int
		err error
	}
	ctx, cancel := context.WithTimeout(c.Context, attemptTimeout(c))
	done := make(chan probe, len(clients))
	var wg sync.WaitGroup
	// Deferred after the clients' Close, so run before it: the probes
	// still out are ended, and waited for, before their clients close.
	defer wg.Wait()
	defer cancel()
	for i, cl := range clients {
		wg.Add(1)
		go func() {
			defer wg.Done()
			_, err := cl.Ready(ctx)
			done <- probe{i, err}
		}()
	}
	probes := make([]error, len(eps))
	answered := make([]bool, len(eps))
	took := func(p probe) bool {
		var ae *client.Error
		probes[p.i] = p.err
		answered[p.i] = p.err == nil || errors.As(p.err, &ae)
		return answered[p.i]
	}
	first := false
	for range eps {
		if took(<-done) {
			first = true
			break
		}
	}
	if c.Context.Err() != nil {
		return nil, fmt.Errorf("snapshot restore: %w; nothing was sent to the cluster", c.Context.Err())
	}
	if first {
		// Those whose answer came meanwhile are taken too, so that a
		// refusal of the first (no leader) moves on to them.
		for more := true; more; {
			select {
			case p := <-done:
				took(p)
			default:
				more = false
			}
		}
		var ok []string
		for i, a := range answered {
			if a {
				ok = append(ok, eps[i])
			}
		}
		return ok, nil
	}
	var errs []string
	var certErr *tls.CertificateVerificationError
	for i, err := range probes {
		if errors.Is(err, context.DeadlineExceeded) {
			errs = append(errs, eps[i]+": no answer")
		} else {
			errs = append(errs, oneLine(err.Error()))
		}
		if certErr == nil {
			errors.As(err, &certErr)
		}
	}
	err = fmt.Errorf("snapshot restore: no endpoint answered a readiness probe within %v (%s): %w; nothing was sent to the cluster",
		attemptTimeout(c), strings.Join(errs, "; "), client.ErrUnreachable)
	if certErr != nil {
		return nil, &causedError{error: err, cause: certErr}
	}
	return nil, err
}

// causedError is an error that also wraps a cause its text already tells
// of (a probe's certificate refusal, in the list of the probes' errors).
// Only that cause is kept so: a probe's other errors (a timeout, which is
// a context.DeadlineExceeded) would read as the command's own.
type causedError struct {
	error
	cause error
}

func (e *causedError) Unwrap() []error { return []error{e.error, e.cause} }

// snapshotSeed writes the file into a new node's data directory.
func snapshotSeed(c *cli.Context, e *env, path string) error {
	dir, id, peersArg := c.String("data-dir"), c.String("node-id"), c.String("peers")
	if dir == "" {
		return usagef("--data-dir is empty: give the new node's data directory (or leave --data-dir out, to restore online)")
	}
	if id == "" || peersArg == "" {
		return usagef("seeding --data-dir needs --node-id ID and --peers id=raftaddr=httpaddr,...")
	}
	peers, err := parsePeers(peersArg)
	if err != nil {
		return err
	}
	if !slices.ContainsFunc(peers, func(m raftfsm.Member) bool { return m.ID == id }) {
		return usagef("--node-id %q is not one of --peers", id)
	}
	if err := regularFile(c, path); err != nil {
		return err
	}
	info, err := inspectFile(c.Context, e, path)
	if err != nil {
		return fmt.Errorf("%w; nothing was written to %s", err, dir)
	}
	if err := e.seed(c.Context, path, dir, id, peers); err != nil {
		return fmt.Errorf("seed %s: %w", dir, err)
	}
	if jsonOut(c) {
		return writeJSON(e.stdout, map[string]any{"seeded": dir, "node_id": id, "file": path,
			"index": info.Index, "term": info.Term, "peers": peers})
	}
	_, err = fmt.Fprintf(e.stdout, "seeded %s for node %s from %s (index %d, term %d); seed every peer the same way, then start each with --peers %s\n",
		dir, id, path, info.Index, info.Term, peersArg)
	return err
}

// parsePeers parses id=raftaddr=httpaddr,... as kvrouter --peers does
// (raftfsm.ParsePeers: host:port addresses, Raft addresses that kvrouter
// would take as --raft-addr and peers can dial, no id or address twice),
// and wants at least one peer: a seed with peers kvrouter refuses would
// leave a directory that no node can start on.
func parsePeers(s string) ([]raftfsm.Member, error) {
	out, err := raftfsm.ParsePeers(s)
	if err != nil {
		return nil, usagef("--peers: %v", err)
	}
	if len(out) == 0 {
		return nil, usagef("--peers: no peers given")
	}
	return out, nil
}

// progress returns a progress bar on stderr when stderr is a terminal and
// the output is a table; nil otherwise, so that pipes and -o json get no
// progress text. total < 0: unknown.
func (e *env) progress(c *cli.Context, total int64, desc string) *progressbar.ProgressBar {
	if !e.terminal || jsonOut(c) {
		return nil
	}
	return progressbar.NewOptions64(total,
		progressbar.OptionSetWriter(e.stderr),
		progressbar.OptionSetDescription(desc),
		progressbar.OptionShowBytes(true),
		progressbar.OptionShowTotalBytes(true),
		progressbar.OptionUseIECUnits(true),
		progressbar.OptionSetWidth(24),
		progressbar.OptionThrottle(100*time.Millisecond),
		progressbar.OptionSpinnerType(14),
		progressbar.OptionSetSpinnerChangeInterval(0), // renders on writes; no ticker goroutine
		progressbar.OptionClearOnFinish(),
	)
}

func finishBar(bar *progressbar.ProgressBar) {
	if bar != nil {
		_ = bar.Finish()
		_ = bar.Clear()
	}
}

// uploadFile is the file an online restore uploads. Its reads move a
// progress bar (nil: none) and arm stall, which fires once no read came
// for stallAfter; the request written whole (traced) and a rewind (a
// retry on another endpoint, after a dial that may take a while) stop
// it. Not the file's end: its last bytes are still to be sent then, and
// a node that stops reading within them held the restore for ever. It keeps
// *os.File's Stat and Seek, so the client still sends a Content-Length
// and can rewind for a retry. The client reads it from one goroutine at a
// time (it rewinds only once the transport is done with it).
type uploadFile struct {
	*os.File
	size       int64
	pos        int64
	bar        *progressbar.ProgressBar
	stall      *time.Timer
	stallAfter time.Duration
	// wrote: the transport wrote the request out whole (traced), since
	// the last rewind. Set from the transport's goroutine.
	wrote atomic.Bool
}

func (u *uploadFile) Read(b []byte) (int, error) {
	n, err := u.File.Read(b)
	u.pos += int64(n)
	if u.bar != nil {
		_ = u.bar.Add(n)
	}
	if err != nil && err != io.EOF {
		u.stall.Stop() // the transport gives the request up
	} else {
		u.stall.Reset(u.stallAfter)
	}
	return n, err
}

// traced returns ctx with a trace that stops the stall timer once the
// transport has written the request out (WroteRequest). Until then a
// read's bytes may still wait to go: an HTTP/1 transport writes each
// read's bytes to the connection, and an HTTP/2 one waits for the node's
// window, before it reads again (and finds the file's end).
func (u *uploadFile) traced(ctx context.Context) context.Context {
	return httptrace.WithClientTrace(ctx, &httptrace.ClientTrace{
		WroteRequest: func(info httptrace.WroteRequestInfo) {
			u.stall.Stop()
			if info.Err == nil {
				u.wrote.Store(true)
			}
		},
	})
}

// stalledErr returns the error of a restore that the stall bound ended
// before the transport wrote the request out, and nil for any other end.
// Nothing was installed then, as a node takes an upload only whole,
// whatever the client makes of it: it calls the outcome unknown
// (ErrOutcomeUnknown) once it has read the file's end, and a node that
// stopped reading within the last chunk never got those bytes. Not when
// the request went out whole meanwhile (its last write raced the timer):
// that outcome is unknown, and said so.
func (u *uploadFile) stalledErr(ctx context.Context) error {
	if !errors.Is(context.Cause(ctx), errUploadStalled) || u.wrote.Load() {
		return nil
	}
	return fmt.Errorf("snapshot restore: the node %w for --timeout %v, and kvctl gave up; nothing was installed: see kvctl status, and retry with another endpoint first",
		errUploadStalled, u.stallAfter)
}

func (u *uploadFile) Seek(off int64, whence int) (int64, error) {
	pos, err := u.File.Seek(off, whence)
	u.wrote.Store(false) // a retry writes the request anew
	if err == nil {
		u.pos = pos
		if u.bar != nil {
			_ = u.bar.Set64(pos)
		}
	}
	u.stall.Stop()
	return pos, err
}
