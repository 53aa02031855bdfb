//go:build race

package indexer

const raceEnabled = true
