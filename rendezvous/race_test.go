//go:build race

package rendezvous_test

// raceEnabled: the race detector slows every goroutine several-fold, which
// changes how many batches a crowd's requests land in.
const raceEnabled = true
