package client

import "testing"

// SetMaxAnswerBytes lowers the bound on a JSON answer for the rest of t.
func SetMaxAnswerBytes(t testing.TB, n int64) {
	was := maxAnswerBytes
	maxAnswerBytes = n
	t.Cleanup(func() { maxAnswerBytes = was })
}
