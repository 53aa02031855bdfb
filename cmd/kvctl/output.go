package main

import (
	"encoding/json"
	"fmt"
	"io"
	"math"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"
	"unicode/utf8"
)

// writeJSON writes v as indented JSON.
func writeJSON(w io.Writer, v any) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(v)
}

// table writes aligned columns.
type table struct{ tw *tabwriter.Writer }

func newTable(w io.Writer, header ...string) *table {
	t := &table{tw: tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)}
	if len(header) > 0 {
		t.row(header...)
	}
	return t
}

// row writes one line. Its cells are escaped (cell): a cell is node data
// (a worker's model, a member's address) or a path, and a line break or a
// tab in one would split the row or forge others.
func (t *table) row(cells ...string) {
	esc := make([]string, len(cells))
	for i, c := range cells {
		esc[i] = cell(c)
	}
	fmt.Fprintln(t.tw, strings.Join(esc, "\t"))
}

// cell returns s as it is when it is valid UTF-8 of printable characters
// and spaces, and Go-quoted (strconv.Quote) otherwise, so that it stays
// one cell of one row.
func cell(s string) string {
	if utf8.ValidString(s) && strings.IndexFunc(s, func(r rune) bool { return !strconv.IsPrint(r) }) < 0 {
		return s
	}
	return strconv.Quote(s)
}

func (t *table) flush() error { return t.tw.Flush() }

func u64(v uint64) string { return strconv.FormatUint(v, 10) }
func i64(v int64) string  { return strconv.FormatInt(v, 10) }

// num prints a float compactly: integers as integers, others with two
// decimals.
func num(v float64) string {
	if v == math.Trunc(v) && math.Abs(v) < 1e15 {
		return strconv.FormatFloat(v, 'f', 0, 64)
	}
	return strconv.FormatFloat(v, 'f', 2, 64)
}

func orDash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}

func yesNo(b bool) string {
	if b {
		return "yes"
	}
	return "no"
}

// size prints a byte count in IEC units.
func size(n int64) string {
	const unit = 1024
	if n < unit {
		return fmt.Sprintf("%d B", n)
	}
	div, exp := int64(unit), 0
	for m := n / unit; m >= unit && exp < 5; m /= unit {
		div *= unit
		exp++
	}
	v := float64(n) / float64(div)
	// The unit is picked before the value is rounded to one decimal: one
	// that rounds to 1024 (1<<20-1 bytes) is 1.0 of the next unit.
	if v >= unit-0.05 && exp < 5 {
		v /= unit
		exp++
	}
	return fmt.Sprintf("%.1f %ciB", v, "KMGTPE"[exp])
}

// ago prints a last-contact time in milliseconds.
func ago(ms int64) string {
	switch {
	case ms < 0:
		return "never"
	case ms == 0:
		return "0s"
	}
	return (time.Duration(ms) * time.Millisecond).String()
}
