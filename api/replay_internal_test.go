package api

import (
	"io"
	"strings"
	"testing"
)

func TestReplayBodyGivesBackWhatWasReadAndTheRest(t *testing.T) {
	const body = "0123456789abcdef"
	b := newReplayBody(io.NopCloser(strings.NewReader(body)), 10)
	head := make([]byte, 6)
	if _, err := io.ReadFull(b, head); err != nil {
		t.Fatal(err)
	}
	r, ok := b.replay()
	if !ok {
		t.Fatal("6 bytes read of a 10-byte allowance: not replayable")
	}
	if got, _ := io.ReadAll(r); string(got) != body {
		t.Fatalf("replay = %q, want %q", got, body)
	}
}

func TestReplayBodyPastItsAllowanceCannotReplay(t *testing.T) {
	b := newReplayBody(io.NopCloser(strings.NewReader(strings.Repeat("x", 100))), 10)
	if _, err := io.ReadAll(b); err != nil {
		t.Fatal(err)
	}
	if _, ok := b.replay(); ok {
		t.Fatal("100 bytes read of a 10-byte allowance: replayable")
	}
	if b.kept.Len() != 0 {
		t.Fatalf("kept %d bytes after giving up", b.kept.Len())
	}
}

func TestLeaderURL(t *testing.T) {
	for in, want := range map[string]string{
		"10.0.0.1:7080":       "http://10.0.0.1:7080",
		"http://h:1":          "http://h:1",
		"https://h:1/ignored": "https://h:1",
		"[::1]:7080":          "http://[::1]:7080",
		// A zone is a host:port's as written, a URL's escaped (%25).
		"[fe80::1%eth0]:7080":          "http://[fe80::1%25eth0]:7080",
		"http://[fe80::1%25eth0]:7080": "http://[fe80::1%25eth0]:7080",
	} {
		u, err := leaderURL(in, "http")
		if err != nil || u.String() != want {
			t.Errorf("leaderURL(%q) = %v, %v; want %s", in, u, err, want)
		}
	}
	if u, err := leaderURL("h:1", "https"); err != nil || u.String() != "https://h:1" {
		t.Errorf(`leaderURL("h:1", "https") = %v, %v; want https://h:1`, u, err)
	}
	for _, bad := range []string{"", "ftp://h:1", "http://", "a/b:1", "h:1/path", "h:1?q", "u@h:1", "[fe80::1%eth0]:7080/x"} {
		if _, err := leaderURL(bad, "http"); err == nil {
			t.Errorf("leaderURL(%q) accepted", bad)
		}
	}
}
