package eventplane

import (
	"strings"
	"testing"
)

// TestCheckNATSURLs: a --nats-url must list NATS URLs as nats.Connect
// takes them (kvagent's and kvrouter's check, exit 2). From a review:
// "http//bad url" started an agent that retried it for ever, without a
// word.
func TestCheckNATSURLs(t *testing.T) {
	for _, u := range []string{"http//bad url", "http://127.0.0.1:4222", "nats://", "", " , ", "nats://h:99999", "nats://h:x",
		"nats://127.0.0.1:4222,ws://127.0.0.1:8080", "nats://h:4222/path"} {
		if err := CheckNATSURLs(u); err == nil {
			t.Errorf("CheckNATSURLs(%q) = nil, want an error", u)
		}
	}
	for _, u := range []string{"nats://127.0.0.1:4222", "127.0.0.1:4222", "nats://a:4221, tls://b:4222", "localhost", "nats://h:4222,",
		"nats://user:pass@h:4222", "wss://h", "[::1]:4222", "wss://nats.example.com/nats", "ws://h:8080/nats?x=1"} {
		if err := CheckNATSURLs(u); err != nil {
			t.Errorf("CheckNATSURLs(%q): %v", u, err)
		}
	}
	if err := CheckNATSURLs("http://alice:s3cret@h:4222"); err == nil || strings.Contains(err.Error(), "s3cret") || !strings.Contains(err.Error(), "alice") {
		t.Errorf("CheckNATSURLs of a URL with a password: %v, want an error naming the user and not the password", err)
	}
}

// TestRedactURLs: each URL's password is hidden and the rest kept, with
// or without a scheme, parsed or not. From a review: kvrouter logged
// --nats-url as given, password and all.
func TestRedactURLs(t *testing.T) {
	for in, want := range map[string]string{
		"nats://a:1, nats://alice:s3cret@h:4222": "nats://a:1, nats://alice:xxxxx@h:4222",
		"alice:s3cret@h:4222":                    "alice:xxxxx@h:4222",
		"nats://alice:p@ss@h:4222":               "nats://alice:xxxxx@h:4222",
		"tls://alice:s3cret@h:4222 bad url":      "tls://alice:xxxxx@h:4222 bad url",
		"nats://alice@h:4222":                    "nats://alice@h:4222",
		"ws://h:8080/nats?x=a@b":                 "ws://h:8080/nats?x=a@b",
		"http//bad url":                          "http//bad url",
		"":                                       "",
	} {
		if got := RedactURLs(in); got != want {
			t.Errorf("RedactURLs(%q) = %q, want %q", in, got, want)
		}
	}
}
