//go:build !race

package raftfsm

const raceEnabled = false
