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
