package main

import (
	"context"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/raftfsm"
)

// TestARestartWithoutPeersIsNotWarnedOf: 2eb3f6f's Warn is for --peers
// given on a restart that differ from the stored configuration; "the
// same --peers (the usual command line) and none log nothing". But
// kvrouter started with neither --peers nor --join passes the node
// Peers = [this node alone] (the single-node default), so every member of
// a cluster restarted without --peers (operations.md: "a member
// restarted without --peers or --join") is told at Warn that its --peers
// differ and are ignored, with peers=n1=... naming flags it never got.
func TestARestartWithoutPeersIsNotWarnedOf(t *testing.T) {
	r1, r2, h1, h2 := freeAddr(t), freeAddr(t), freeAddr(t), freeAddr(t)
	peers := []raftfsm.Member{{ID: "n1", RaftAddr: r1, HTTPAddr: h1, Voter: true}, {ID: "n2", RaftAddr: r2, HTTPAddr: h2, Voter: true}}
	dir := t.TempDir()
	n, err := raftfsm.NewNode(raftfsm.Config{ID: "n1", RaftAddr: r1, HTTPAddr: h1, DataDir: dir, Peers: peers, Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	n.Close()
	logFile, err := os.Create(filepath.Join(t.TempDir(), "stderr"))
	if err != nil {
		t.Fatal(err)
	}
	stderr := os.Stderr
	os.Stderr = logFile
	err = runKvrouterFor(t, 2*time.Second, "--node-id", "n1", "--data-dir", dir, "--raft-addr", r1, "--http-addr", h1,
		"--nats-addr", "127.0.0.1:0", "--log-level", "warn")
	os.Stderr = stderr
	logFile.Close()
	if err != nil {
		t.Fatalf("member n1 restarted without --peers: %v", err)
	}
	out, _ := os.ReadFile(logFile.Name())
	for l := range strings.Lines(string(out)) {
		if strings.Contains(l, "--peers differ from the Raft configuration") {
			t.Fatalf("member n1 of a 2-node cluster restarted without --peers or --join was warned of --peers it was not given: %s", strings.TrimSpace(l))
		}
	}
}

// TestASeededDirectoryStartedWithoutPeers: the same default (Peers =
// [this node] when neither --peers nor --join is given) reaches
// checkSeedPeers: a seeded directory's first start without --peers is
// refused with "--peers names others", naming a flag that was not given.
func TestASeededDirectoryStartedWithoutPeers(t *testing.T) {
	r1, r2, h1, h2 := freeAddr(t), freeAddr(t), freeAddr(t), freeAddr(t)
	src := t.TempDir()
	self := []raftfsm.Member{{ID: "n1", RaftAddr: r1, HTTPAddr: h1, Voter: true}}
	n, err := raftfsm.NewNode(raftfsm.Config{ID: "n1", RaftAddr: r1, HTTPAddr: h1, DataDir: src, Peers: self, Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	n.Close()
	file := filepath.Join(t.TempDir(), "b.snap")
	f, err := os.Create(file)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := raftfsm.SaveDataDir(context.Background(), src, f, raftfsm.SaveOptions{}); err != nil {
		t.Fatal(err)
	}
	f.Close()
	dir := filepath.Join(t.TempDir(), "seeded")
	peers := []raftfsm.Member{{ID: "n1", RaftAddr: r1, HTTPAddr: h1, Voter: true}, {ID: "n2", RaftAddr: r2, HTTPAddr: h2, Voter: true}}
	if err := raftfsm.SeedDataDir(context.Background(), file, dir, "n1", peers); err != nil {
		t.Fatal(err)
	}
	err = runKvrouterFor(t, 2*time.Second, "--node-id", "n1", "--data-dir", dir, "--raft-addr", r1, "--http-addr", h1,
		"--nats-addr", "127.0.0.1:0", "--log-level", "error")
	if err != nil && strings.Contains(err.Error(), "--peers names others") {
		t.Fatalf("a seeded directory's first start without --peers: %v: names --peers, which was not given", err)
	}
}
