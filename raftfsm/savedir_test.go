package raftfsm

import (
	"bytes"
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// TestSaveDataDirOfASurvivorSeedsANewCluster: a 3-node cluster that lost
// two of its disks for good keeps its acknowledged writes on the
// survivor's. Saved offline from the survivor's stopped directory
// (SaveDataDir) and seeded into a new single-node cluster (SeedDataDir),
// they are all there: the new node's digest is the old cluster's. A
// follower survivor that was killed holds its last writes only in its
// Raft log (its FSM's open group was lost): the default save applies the
// log's tail and has them; an --applied-only save lacks them. The
// survivor's directory is left as it was.
func TestSaveDataDirOfASurvivorSeedsANewCluster(t *testing.T) {
	for _, follower := range []bool{false, true} {
		name := "leader"
		if follower {
			name = "killed follower"
		}
		t.Run(name, func(t *testing.T) {
			c := newTestCluster(t, 3, steadyTimeouts)
			for id := uint64(1); id <= 3; id++ {
				if err := c.leader().RegisterWorker(ctx(t), WorkerInfo{ID: id, DPRanks: []uint32{0}, BlockSize: 16}); err != nil {
					t.Fatal(err)
				}
			}
			ingestRetrying(t, c, []RankBatch{{Rank: r1, Events: chainEvents(r1, 1, 20, 7)}})
			s := c.followerOf(c.leader())
			if !follower {
				s = slicesIndex(c.nodes, c.leader())
			}
			if follower {
				// Restarted: its state is durable up to here (Close commits
				// the open group); what follows stays in its group.
				c.converged()
				c.stop(s)
				c.start(s)
			}
			if err := c.leader().RegisterWorker(ctx(t), WorkerInfo{ID: 9, DPRanks: []uint32{0}, BlockSize: 16}); err != nil {
				t.Fatal(err)
			}
			ingestRetrying(t, c, []RankBatch{{Rank: r1, Events: chainEvents(r1, 21, 5, 70)}})
			want := c.converged()
			if follower {
				c.crash(s) // kill -9: the applies since the restart are only in its log
			} else {
				c.stop(s)
			}
			for j := range c.nodes {
				if j != s {
					c.stop(j)
					if err := os.RemoveAll(c.dirs[j]); err != nil {
						t.Fatal(err)
					}
				}
			}
			before := treePrint(t, c.dirs[s])

			full, rep := saveDir(t, c.dirs[s], SaveOptions{})
			if rep.Snapshot.Index != rep.AppliedIndex && rep.LogEntries == 0 {
				t.Errorf("report %+v: the stream's index is not the state's", rep)
			}
			if follower && (rep.AppliedIndex >= rep.LogLastIndex || rep.LogEntries == 0) {
				t.Fatalf("report %+v: want a state applied below the log's end, and the log's tail applied", rep)
			}
			if got := seededDigest(t, full, nil); got != want {
				t.Fatalf("the new cluster's digest %#x, want the old cluster's %#x (report %+v)", got, want, rep)
			}
			if follower {
				only, rep := saveDir(t, c.dirs[s], SaveOptions{AppliedOnly: true})
				if rep.LogEntries != 0 || rep.LogEntriesLeft == 0 {
					t.Fatalf("--applied-only report %+v: want no log entry applied, some left", rep)
				}
				if got := seededDigest(t, only, func(n *Node) {
					if _, ok := n.fsm.Workers()[9]; ok {
						t.Errorf("--applied-only holds worker 9, registered after the survivor's last group")
					}
				}); got == want {
					t.Fatalf("--applied-only: the new cluster's digest is the old cluster's %#x; want it without the log's tail", want)
				}
			}
			if after := treePrint(t, c.dirs[s]); after != before {
				t.Fatalf("the save changed the survivor's directory:\nbefore:\n%s\nafter:\n%s", before, after)
			}
		})
	}
}

// TestSaveDataDirRefusesADirectoryInUse: a running node's directory is
// refused (ErrDataDirInUse), and nothing is written.
func TestSaveDataDirRefusesADirectoryInUse(t *testing.T) {
	c := newTestCluster(t, 1, nil)
	c.leader()
	var buf bytes.Buffer
	_, err := SaveDataDir(context.Background(), c.dirs[0], &buf, SaveOptions{TempDir: t.TempDir()})
	if !errors.Is(err, ErrDataDirInUse) {
		t.Fatalf("save of a running node's directory: %v, want ErrDataDirInUse", err)
	}
	if buf.Len() != 0 {
		t.Fatalf("the refused save wrote %d bytes", buf.Len())
	}
	if _, err := SaveDataDir(context.Background(), t.TempDir(), &buf, SaveOptions{TempDir: t.TempDir()}); !errors.Is(err, ErrInvalid) {
		t.Fatalf("save of a directory without node state: %v, want ErrInvalid", err)
	}
	// A state a start refuses (its raft/ and snapshots/ lost) is refused,
	// and the refusal names the data directory, not the save's copy.
	if err := c.leader().RegisterWorker(ctx(t), WorkerInfo{ID: 1, BlockSize: 16}); err != nil {
		t.Fatal(err)
	}
	c.stop(0)
	for _, sub := range []string{"raft", "snapshots"} {
		if err := os.RemoveAll(filepath.Join(c.dirs[0], sub)); err != nil {
			t.Fatal(err)
		}
	}
	_, err = SaveDataDir(context.Background(), c.dirs[0], &buf, SaveOptions{TempDir: t.TempDir()})
	if !errors.Is(err, ErrStartRefused) || !strings.Contains(err.Error(), filepath.Join(c.dirs[0], "fsm")) || strings.Contains(err.Error(), ".kvrouter-save-") {
		t.Fatalf("save of a state without its log: %v, want ErrStartRefused naming %s", err, filepath.Join(c.dirs[0], "fsm"))
	}
}

func slicesIndex(nodes []*Node, n *Node) int {
	for i, m := range nodes {
		if m == n {
			return i
		}
	}
	return -1
}

// saveDir saves dir offline into a file and returns its path and the report.
func saveDir(t *testing.T, dir string, opts SaveOptions) (string, SaveReport) {
	t.Helper()
	out := t.TempDir()
	opts.TempDir = out
	var buf bytes.Buffer
	rep, err := SaveDataDir(context.Background(), dir, &buf, opts)
	if err != nil {
		t.Fatalf("save %s: %v", dir, err)
	}
	info, err := InspectSnapshot(bytes.NewReader(buf.Bytes()))
	if err != nil || info.SHA256 != rep.Snapshot.SHA256 || info.Bytes != int64(buf.Len()) {
		t.Fatalf("the saved stream inspects as %+v, %v; the save reported %+v", info, err, rep.Snapshot)
	}
	if left, _ := os.ReadDir(out); len(left) != 0 {
		t.Fatalf("the save left %v in its temporary directory", left)
	}
	file := filepath.Join(out, "saved.snap")
	if err := os.WriteFile(file, buf.Bytes(), 0o600); err != nil {
		t.Fatal(err)
	}
	return file, rep
}

// seededDigest seeds a new single-node cluster from file, starts it, runs
// check on it and returns its digest.
func seededDigest(t *testing.T, file string, check func(*Node)) uint64 {
	t.Helper()
	c := &testCluster{t: t}
	tr := c.transport("127.0.0.1:0")
	c.dirs = []string{filepath.Join(t.TempDir(), "m1")}
	c.addrs = []string{string(tr.LocalAddr())}
	c.nodes = []*Node{nil}
	t.Cleanup(c.close)
	if err := SeedDataDir(context.Background(), file, c.dirs[0], c.id(0), c.peers()); err != nil {
		t.Fatalf("seed: %v", err)
	}
	c.startOn(0, tr)
	n := c.leader()
	cx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := n.WaitReady(cx); err != nil {
		t.Fatalf("the seeded node: %v", err)
	}
	if check != nil {
		check(n)
	}
	d := n.fsm.Digest()
	c.stop(0)
	return d
}

// treePrint lists every file under dir with its size and content hash.
func treePrint(t *testing.T, dir string) string {
	t.Helper()
	var b strings.Builder
	err := filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(dir, p)
		if d.IsDir() {
			fmt.Fprintf(&b, "%s/\n", rel)
			return nil
		}
		data, err := os.ReadFile(p)
		if err != nil {
			return err
		}
		fmt.Fprintf(&b, "%s %d %x\n", rel, len(data), sha256.Sum256(data))
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return b.String()
}
