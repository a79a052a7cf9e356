//go:build race

package main

// raceEnabled: the tests run under the race detector, and so do the worker
// processes they build.
const raceEnabled = true
