package api

import (
	"io"
	"net/url"
	"strings"
	"testing"

	"github.com/kvrouter/kvrouter/raftfsm"
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

// TestReplayedBodyIsNotReused: a body handed to a forward is not given
// back to the pool by release: the forward's transport may still read its
// kept bytes after the handler returned, and a later request reusing the
// buffer would overwrite them under it.
func TestReplayedBodyIsNotReused(t *testing.T) {
	b := newReplayBody(io.NopCloser(strings.NewReader("hello world")), 1024)
	if _, err := io.ReadFull(b, make([]byte, 5)); err != nil {
		t.Fatal(err)
	}
	r, ok := b.replay()
	if !ok {
		t.Fatal("a body within its allowance cannot replay")
	}
	b.release()
	// What a later request does with a body it got from the pool: b,
	// were it there.
	b.rc = io.NopCloser(strings.NewReader("XXXXX"))
	if _, err := io.ReadFull(b, make([]byte, 5)); err != nil {
		t.Fatal(err)
	}
	if got, err := io.ReadAll(r); err != nil || string(got) != "hello world" {
		t.Fatalf("the forward read %q, %v after the handler released the body; want %q", got, err, "hello world")
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
	for _, bad := range []string{"", "ftp://h:1", "http://", "a/b:1", "h:1/path", "h:1?q", "u@h:1", "[fe80::1%eth0]:7080/x", "h x:1", "h:0"} {
		if _, err := leaderURL(bad, "http"); err == nil {
			t.Errorf("leaderURL(%q) accepted", bad)
		}
	}
}

// FuzzLeaderURLTakesEveryMemberHTTPAddr: every HTTP address the members
// API takes (raftfsm.CheckHTTPAddr) is one a follower forwards to, at a
// URL that reads back as that very host. From a review: the API took
// hosts with a '/', '@', ' ', '?' or '#', which leaderURL refused, and
// every write sent to a follower was 503 no_leader once that member led.
func FuzzLeaderURLTakesEveryMemberHTTPAddr(f *testing.F) {
	for _, s := range []string{"10.0.0.1:7080", "n4.example:7080", "N4.:07080", "[::1]:7080", "[fe80::1%eth0.1]:7080",
		"[::ffff:10.0.0.1]:1", "n4 example:7080", "u@n4:7080", "n4/x:7080", "[n4]:7080", "[fe80::1%a~b_c-d]:65535"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, addr string) {
		if raftfsm.CheckHTTPAddr(addr) != nil {
			return
		}
		u, err := leaderURL(addr, "http")
		if err != nil {
			t.Fatalf("CheckHTTPAddr takes %q, leaderURL refuses it: %v", addr, err)
		}
		back, err := url.Parse(u.String())
		if err != nil || back.Host != addr {
			t.Fatalf("%q: the forward's URL %s reads back as host %q (%v)", addr, u, back.Host, err)
		}
	})
}
