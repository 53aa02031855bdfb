package eventplane

import (
	"math/rand/v2"
	"net"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/internal/testseed"
	"github.com/nats-io/nats.go"
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
	if err := CheckNATSURLs("nats://alice:s3cret@h:99999"); err == nil || strings.Contains(err.Error(), "s3cret") || !strings.Contains(err.Error(), "alice:xxxxx@h") {
		t.Errorf("CheckNATSURLs of a URL with a password: %v, want an error naming the URL redacted", err)
	}
}

// TestRedactURLs: each URL's password is hidden and the rest kept, with
// or without a scheme, parsed or not; a user with no password is a token
// and is hidden. From reviews: kvrouter logged --nats-url as given,
// password and all; then a token (nats://TOKEN@host) as given.
func TestRedactURLs(t *testing.T) {
	for in, want := range map[string]string{
		"nats://a:1, nats://alice:s3cret@h:4222": "nats://a:1, nats://alice:xxxxx@h:4222",
		"alice:s3cret@h:4222":                    "alice:xxxxx@h:4222",
		"nats://alice:p@ss@h:4222":               "nats://alice:xxxxx@h:4222",
		"tls://alice:s3cret@h:4222 bad url":      "tls://alice:xxxxx@h:4222 bad url",
		"nats://alice@h:4222":                    "nats://xxxxx@h:4222",
		"ws://alice@h:8080/nats":                 "ws://xxxxx@h:8080/nats",
		"s3cretToken@h:4222":                     "xxxxx@h:4222",
		"h:4222, s3cretToken@h2":                 "h:4222, xxxxx@h2",
		"nats://to:ken@h, nats://s3cretToken@h2": "nats://to:xxxxx@h, nats://xxxxx@h2",
		"nats://alice:pa/s3cret@h:4222":          "nats://alice:xxxxx@h:4222",
		"nats://alice:pa#s3cret@h:4222":          "nats://alice:xxxxx@h:4222",
		"alice:pa://s3cret@h:4222":               "alice:xxxxx@h:4222",
		"alice://s3cret@h:4222":                  "alice:xxxxx@h:4222",
		"http://alice:s3cret@h:4222":             "http:xxxxx@h:4222",
		"NATS://alice:s3cret@h:4222":             "NATS://alice:xxxxx@h:4222",
		" nats://alice:s3cret@h:4222":            " nats://alice:xxxxx@h:4222",
		"nats://alice:pa,s3cret@h:4222":          "nats://alice:xxxxx@h:4222",
		"nats://alice:,s3:cret@h:4222":           "nats://alice:xxxxx@h:4222",
		"h:4222, alice:s3cret@h2":                "h:4222, alice:xxxxx@h2",
		"nats://[::1]:4222,nats://alice:pw@h":    "nats://[::1]:4222,nats://alice:xxxxx@h",
		// An '@' in a websocket path or query reads as the end of a
		// password: the text cannot tell ws://alice:8080/x@h (a password
		// "8080/x") from a port and path.
		"ws://h:8080/nats?x=a@b": "ws://h:xxxxx@b",
		"http//bad url":          "http//bad url",
		"":                       "",
	} {
		if got := RedactURLs(in); got != want {
			t.Errorf("RedactURLs(%q) = %q, want %q", in, got, want)
		}
	}
}

// TestRedactKeepsATokenListsURLs: a list whose later URL has a user but
// no password (a token) is not a password cut at a ',': its URLs show as
// given, the token hidden. From a review: a host:port part was merged
// with a later user@host part and the merged text redacted as a password
// (nats://h1:4222,bob@h2:4222 showed as nats://h1:xxxxx@h2:4222).
func TestRedactKeepsATokenListsURLs(t *testing.T) {
	for in, want := range map[string]string{
		"nats://h1:4222,bob@h2:4222":     "nats://h1:4222,xxxxx@h2:4222",
		"h1:4222,h2:4222,bob@h3:4222":    "h1:4222,h2:4222,xxxxx@h3:4222",
		"[::1]:4222,bob@h2":              "[::1]:4222,xxxxx@h2",
		"nats://[::1]:4222, bob@h2:4222": "nats://[::1]:4222, xxxxx@h2:4222",
	} {
		if got := RedactURLs(in); got != want {
			t.Errorf("RedactURLs(%q) = %q, want %q (the URLs as given, the token hidden)", in, got, want)
		}
	}
	// A password cut at a ',' whose first piece is not a port is still
	// hidden whole.
	for in, want := range map[string]string{
		"nats://alice:pa,s3cret@h:4222":         "nats://alice:xxxxx@h:4222",
		"h1:4222,nats://alice:pa,s3cret@h:4222": "h1:4222,nats://alice:xxxxx@h:4222",
		"alice:pa,b,s3cret@h":                   "alice:xxxxx@h",
	} {
		if got := RedactURLs(in); got != want {
			t.Errorf("RedactURLs(%q) = %q, want %q", in, got, want)
		}
	}
}

// TestCheckNATSURLsNeverShowsThePassword: CheckNATSURLs' messages
// (kvrouter's and kvagent's exit 2) and RedactURLs show no password,
// whatever is wrong with the URL. From a review: a typo in the port
// (nats://alice:s3cret@host:abc) showed the password in url.Error's
// quote of the URL, and a password with an unescaped '/', '?' or '#' was
// not redacted (the user information was cut there).
func TestCheckNATSURLsNeverShowsThePassword(t *testing.T) {
	for _, u := range []string{
		"nats://alice:s3cret@host:abc",      // typo in the port: url.Error quotes the raw URL
		"nats://alice:s3cret@ho st:4222",    // space in the host
		"nats://alice:s3cret@[::1:4222",     // unclosed IPv6 bracket
		"nats://alice:s3cret@h:99999",       // port out of range
		"tls://alice:s3cret@h:4222 bad url", // a space in the port
		"nats://alice:pa/s3cret@host:4222",  // unescaped '/' in the password
		"nats://alice:pa#s3cret@host:4222",  // unescaped '#' in the password
		"nats://alice:pa?s3cret@host:4222",  // unescaped '?' in the password
		"nats://alice:12/s3cret@host:4222",  // ... that url.Parse reads as a port and a path
		"nats://alice:pa%zzs3cret@host",     // a bad escape
		"alice:pa://s3cret@host:4222",       // "://" in a password of a URL with no scheme
		"http://alice:s3cret@h:4222",        // another scheme
		"nats://alice:pa,s3cret@host:4222",  // ',' in the password: two URLs to nats.Connect
	} {
		err := CheckNATSURLs(u)
		if err == nil {
			t.Errorf("CheckNATSURLs(%q) = nil, want an error", u)
			continue
		}
		if shown := RedactURLs(u); strings.Contains(err.Error(), "s3cret") || strings.Contains(shown, "s3cret") {
			t.Errorf("CheckNATSURLs(%q): %q\n  RedactURLs: %q\n  shows the password", u, err, shown)
		}
	}
}

// TestNATSURLPasswordsNeverShow: for random passwords holding any of
// / ? # @ : % and spaces, in URLs good and bad, neither CheckNATSURLs'
// message nor RedactURLs shows a byte of the password. The passwords'
// letters (Q, Z, J) appear nowhere else in the URLs or the messages, so
// that any of them in the output is the password's.
func TestNATSURLPasswordsNeverShow(t *testing.T) {
	rng := rand.New(rand.NewPCG(testseed.Seed(t), 0))
	const letters, others = "QZJ", "/?#@:% "
	forms := []string{
		"nats://alice:%s@host:4222", "alice:%s@host:4222", "tls://alice:%s@h:abc", "nats://alice:%s@ho st:4222",
		"ws://alice:%s@h:8080/nats?x=a@b", "nats://alice:%s@[::1]:4222", "nats://a:4222, nats://alice:%s@b:4222",
		"wss://alice:%s@h", "nats://alice:%s@h:4222/path", "http://alice:%s@h:4222", "alice:%s@[::1:4222",
	}
	for i := 0; i < 5000; i++ {
		pw := []byte{letters[rng.IntN(len(letters))]}
		for n := rng.IntN(12); n > 0; n-- {
			if rng.IntN(2) == 0 {
				pw = append(pw, letters[rng.IntN(len(letters))])
			} else {
				pw = append(pw, others[rng.IntN(len(others))])
			}
		}
		rng.Shuffle(len(pw), func(a, b int) { pw[a], pw[b] = pw[b], pw[a] })
		u := strings.Replace(forms[rng.IntN(len(forms))], "%s", string(pw), 1)
		shown := RedactURLs(u)
		msg := ""
		if err := CheckNATSURLs(u); err != nil {
			msg = err.Error()
		}
		if strings.ContainsAny(shown, letters) || strings.ContainsAny(msg, letters) {
			t.Fatalf("password %q in %q:\n  RedactURLs: %q\n  CheckNATSURLs: %q\n  show it", pw, u, shown, msg)
		}
	}
}

// silentProxy forwards TCP to a target until silence, after which it keeps
// every connection open and passes nothing either way: a server that
// hangs (SIGSTOP, a frozen VM) or a host partitioned away without a reset.
type silentProxy struct {
	ln     net.Listener
	silent atomic.Bool
	mu     sync.Mutex
	conns  []net.Conn
}

func newSilentProxy(t *testing.T, target string) *silentProxy {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &silentProxy{ln: ln}
	var wg sync.WaitGroup
	t.Cleanup(func() {
		ln.Close()
		p.mu.Lock()
		for _, c := range p.conns {
			c.Close()
		}
		p.mu.Unlock()
		wg.Wait()
	})
	wg.Go(func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			u, err := net.Dial("tcp", target)
			if err != nil {
				c.Close()
				continue
			}
			p.mu.Lock()
			p.conns = append(p.conns, c, u)
			p.mu.Unlock()
			wg.Go(func() { p.pipe(c, u) })
			wg.Go(func() { p.pipe(u, c) })
		}
	})
	return p
}

// pipe copies src to dst until either fails, dropping what it reads once
// the proxy is silent.
func (p *silentProxy) pipe(dst, src net.Conn) {
	buf := make([]byte, 32<<10)
	for {
		n, err := src.Read(buf)
		if n > 0 && !p.silent.Load() {
			if _, err := dst.Write(buf[:n]); err != nil {
				return
			}
		}
		if err != nil {
			return
		}
	}
}

// TestAClientOfAHungServerMovesToAnother: a connection with NATSOptions
// lists two servers, and the one it is connected to hangs, its TCP
// connection open and silent. Its requests (an agent's heartbeats, 1 s
// apart) all time out until the client takes the connection for dead;
// want it on the other server, which answers all along, within an agent's
// default lease (10 s). From a review: with nats.go's default pings (2
// minutes, 2 outstanding) it took 4 to 6 minutes, the lease long expired.
func TestAClientOfAHungServerMovesToAnother(t *testing.T) {
	const lease = 10 * time.Second // kvagent's --lease default
	var urls []string
	for _, name := range []string{"hangs", "answers"} {
		s, err := StartServer(ServerConfig{Name: name, Addr: "127.0.0.1:0"})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { s.Shutdown(); s.WaitForShutdown() })
		// The router's side: a responder on each server (not clustered).
		rc := connect(t, s.ClientURL())
		if _, err := rc.Subscribe("hb", func(m *nats.Msg) { _ = m.Respond([]byte("ok")) }); err != nil {
			t.Fatal(err)
		}
		if err := rc.Flush(); err != nil {
			t.Fatal(err)
		}
		urls = append(urls, s.ClientURL())
	}
	px := newSilentProxy(t, strings.TrimPrefix(urls[0], "nats://"))
	opts := append(ClientOptions{Name: "agent"}.NATSOptions(), nats.DontRandomize())
	nc, err := nats.Connect("nats://"+px.ln.Addr().String()+","+urls[1], opts...)
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	if _, err := nc.Request("hb", nil, time.Second); err != nil {
		t.Fatalf("request through the server that will hang: %v", err)
	}
	px.silent.Store(true)
	start := time.Now()
	var last error
	for time.Since(start) < lease {
		if _, last = nc.Request("hb", nil, time.Second); last == nil {
			t.Logf("answered by %s %v after the hang", nc.ConnectedUrl(), time.Since(start).Round(100*time.Millisecond))
			return
		}
	}
	t.Fatalf("every request failed for %v, a lease (last: %v; connected to %s): the client stays on the hung server while the other answers",
		time.Since(start).Round(100*time.Millisecond), last, nc.ConnectedUrl())
}
