//go:build !race

package kvevent

const raceEnabled = false
