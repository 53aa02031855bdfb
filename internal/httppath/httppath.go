// Package httppath cleans request paths as net/http's ServeMux does, but on
// the escaped form: an escaped '/' (%2F) in a segment, as in a reservation
// id, stays inside its segment, and the cleaned path keeps its escaping.
// (The mux cleans the escaped path too, but builds its redirect's Location
// from it as if it were unescaped, so %2F comes back as %252F: another
// path.)
package httppath

import (
	"net/url"
	"path"
)

// Clean returns the canonical form of the escaped path p, the one the mux
// redirects to: rooted, without "." or ".." segments or doubled slashes,
// with a trailing slash kept.
func Clean(p string) string {
	if p == "" {
		return "/"
	}
	if p[0] != '/' {
		p = "/" + p
	}
	np := path.Clean(p)
	if p[len(p)-1] == '/' && np != "/" {
		np += "/"
	}
	return np
}

// Cleaned returns u's path cleaned, as a URL's Path and RawPath, and
// whether that differs from u's. ok is false when u's path is clean, or
// when the cleaned escaped path does not unescape (then the caller leaves
// the request as it is, and the mux answers as it would).
func Cleaned(u *url.URL) (decoded, raw string, ok bool) {
	esc := u.EscapedPath()
	clean := Clean(esc)
	if clean == esc {
		return "", "", false
	}
	// clean is esc less some segments and slashes: it unescapes whenever
	// esc does.
	p, err := url.PathUnescape(clean)
	if err != nil {
		return "", "", false
	}
	return p, clean, true
}
