package main

import "testing"

// TestSizeRoundsIntoTheNextUnit: a byte count just under a unit prints as
// 1.0 of that unit, not as 1024.0 of the unit below (snapshot save and
// restore lines, inspect's size, index stats).
func TestSizeRoundsIntoTheNextUnit(t *testing.T) {
	for n, want := range map[int64]string{
		1023: "1023 B", 1024: "1.0 KiB", 1<<20 - 1: "1.0 MiB", 1<<20 - 52: "1023.9 KiB",
		1<<30 - 1: "1.0 GiB", 3 << 20: "3.0 MiB", 1<<62 + 1<<61: "6.0 EiB",
	} {
		if got := size(n); got != want {
			t.Errorf("size(%d) = %q, want %q", n, got, want)
		}
	}
}

// TestCellQuotesAllButPrintableText: a table cell is left as it is when it
// is printable text, and quoted when a control character or invalid UTF-8
// in it could break the table's rows or columns.
func TestCellQuotesAllButPrintableText(t *testing.T) {
	for in, want := range map[string]string{
		"llama 3.1-8B": "llama 3.1-8B", "modèle": "modèle", "-": "-", "": "",
		"a\nb": `"a\nb"`, "a\tb": `"a\tb"`, "a\rb": `"a\rb"`, "\x1b[2J": `"\x1b[2J"`, "a\xffb": `"a\xffb"`,
	} {
		if got := cell(in); got != want {
			t.Errorf("cell(%q) = %s, want %s", in, got, want)
		}
	}
}
