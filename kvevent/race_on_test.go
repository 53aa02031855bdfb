//go:build race

package kvevent

const raceEnabled = true
