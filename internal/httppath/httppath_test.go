package httppath

import (
	"net/url"
	"testing"
)

func TestClean(t *testing.T) {
	for _, c := range []struct{ in, want string }{
		{"", "/"},
		{"/", "/"},
		{"loads", "/loads"},
		{"//loads", "/loads"},
		{"/./loads", "/loads"},
		{"/x/../loads", "/loads"},
		{"/../loads", "/loads"},
		{"/a/b/", "/a/b/"},
		{"/a//b//", "/a/b/"},
		{"/reservations/a%2F..%2Fb", "/reservations/a%2F..%2Fb"},
	} {
		if got := Clean(c.in); got != c.want {
			t.Errorf("Clean(%q) = %q, want %q", c.in, got, c.want)
		}
	}
}

// TestCleanedKeepsEscapes: an escaped '/' stays in its segment and escaped
// after the cleaning; a clean path is left alone.
func TestCleanedKeepsEscapes(t *testing.T) {
	for _, c := range []struct {
		in, decoded, raw string
		ok               bool
	}{
		{"/x/../reservations/a%2Fb", "/reservations/a/b", "/reservations/a%2Fb", true},
		{"/.//reservations/a%2F..%2Fb", "/reservations/a/../b", "/reservations/a%2F..%2Fb", true},
		{"/reservations/a%2Fb", "", "", false},
		{"/loads", "", "", false},
	} {
		u, err := url.Parse(c.in)
		if err != nil {
			t.Fatal(err)
		}
		d, r, ok := Cleaned(u)
		if d != c.decoded || r != c.raw || ok != c.ok {
			t.Errorf("Cleaned(%q) = %q, %q, %v; want %q, %q, %v", c.in, d, r, ok, c.decoded, c.raw, c.ok)
		}
		if ok {
			back := url.URL{Path: d, RawPath: r}
			if back.EscapedPath() != r {
				t.Errorf("Cleaned(%q): the URL's escaped path is %q, want %q", c.in, back.EscapedPath(), r)
			}
		}
	}
}

// FuzzCleanedSettlesInOneStep: a path Cleaned changes comes out clean (a
// redirect to it is not redirected again), its escaping kept (the URL it
// makes writes the cleaned escaped path back), and its decoded form is
// the cleaned escaped path unescaped.
func FuzzCleanedSettlesInOneStep(f *testing.F) {
	for _, s := range []string{
		"", "/", "//", "/./", "/../", "/a/b/../../../c", "/v1//workers", "/./v1/workers/",
		"/v1/requests/a%2F..%2Fb/../x/prefill_done", "/v1/requests/%2E%2E/prefill_done",
		"/x/../reservations/a%2Fb", "/%2e/healthz", "/a%2F..%2Fhealthz", "/.//%2Fevil.com", "/..//\\evil.com",
	} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		u, err := url.ParseRequestURI(s)
		if err != nil || u.Host != "" || u.Scheme != "" || u.Opaque != "" {
			return
		}
		d, r, ok := Cleaned(u)
		if !ok {
			return
		}
		if Clean(r) != r {
			t.Fatalf("Cleaned(%q) = %q, which is not clean (%q)", s, r, Clean(r))
		}
		back := &url.URL{Path: d, RawPath: r}
		if back.EscapedPath() != r {
			t.Fatalf("Cleaned(%q) = %q, %q: the URL writes the escaped path %q", s, d, r, back.EscapedPath())
		}
		if unesc, err := url.PathUnescape(r); err != nil || unesc != d {
			t.Fatalf("Cleaned(%q) = %q, %q: the escaped path unescapes to %q, %v", s, d, r, unesc, err)
		}
		if d2, r2, ok := Cleaned(back); ok {
			t.Fatalf("Cleaned(%q) = %q; cleaned again: %q, %q", s, r, d2, r2)
		}
	})
}
