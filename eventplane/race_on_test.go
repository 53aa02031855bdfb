//go:build race

package eventplane

const raceEnabled = true
