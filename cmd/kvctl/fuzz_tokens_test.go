package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strings"
	"testing"
)

// FuzzReadTokens: a --tokens file or stdin is outside bytes.
// Nothing panics, content that is refused is a usage error (exit 2), and
// ids that are taken read back the same written either way kvctl takes.
func FuzzReadTokens(f *testing.F) {
	for _, s := range []string{"[1,2,3]", "1 2 3", "1,2\n3", "[1,null]", "[", "", "  ", "4294967296", "[-1]", "[1e2]", "1,,2", "[1] [2]"} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, in []byte) {
		ids, err := readTokens(context.Background(), "-", bytes.NewReader(in))
		if err != nil {
			var ue *usageError
			if !errors.As(err, &ue) {
				t.Fatalf("%q: %v, not a usage error", in, err)
			}
			return
		}
		if len(ids) == 0 {
			t.Fatalf("%q: no ids and no error", in)
		}
		js, _ := json.Marshal(ids)
		var sp []string
		for _, v := range ids {
			sp = append(sp, fmt.Sprint(v))
		}
		for _, again := range [][]byte{js, []byte(strings.Join(sp, " "))} {
			got, err := readTokens(context.Background(), "-", bytes.NewReader(again))
			if err != nil || !slices.Equal(got, ids) {
				t.Fatalf("%q: %v re-read from %q as %v, %v", in, ids, again, got, err)
			}
		}
	})
}

// FuzzParseHashes: --hashes never panics; a usage error or hashes
// that read back the same.
func FuzzParseHashes(f *testing.F) {
	for _, s := range []string{"1,2", "0x10, 0X1f", "", ",", "0x", "18446744073709551616", "010"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		hs, err := parseHashes(s)
		if err != nil {
			var ue *usageError
			if !errors.As(err, &ue) {
				t.Fatalf("%q: %v, not a usage error", s, err)
			}
			return
		}
		var sp []string
		for _, v := range hs {
			sp = append(sp, fmt.Sprintf("%#x", v))
		}
		got, err := parseHashes(strings.Join(sp, ","))
		if err != nil || !slices.Equal(got, hs) {
			t.Fatalf("%q: %v re-read as %v, %v", s, hs, got, err)
		}
	})
}
