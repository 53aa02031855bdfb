//go:build !race

package eventplane

const raceEnabled = false
