//go:build !race

package compat

const raceEnabled = false
