package main

import (
	"testing"

	"github.com/kvrouter/kvrouter/internal/doccheck"
)

// TestEveryFlagIsDocumented: every flag kvagent defines is named (`--flag`,
// or in a command line) on some page under docs/, as cmd/kvctl/doc_test.go
// holds kvctl to its reference page: a new flag, or one renamed, failed no
// test while no page said what it does. (internal/doccheck checks the
// other way: every flag the pages name exists.) kvagent has no hidden or
// test-only flag to exempt.
func TestEveryFlagIsDocumented(t *testing.T) {
	doccheck.FlagsDocumented(t, "../../docs", "kvagent", app().Flags)
}
