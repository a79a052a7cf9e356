package launcher

import (
	"fmt"
	"slices"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"

	"github.com/gorunhq/gorun/rendezvous"
)

// TestSlowStoreLogger: the first slow operation of the rendezvous is
// logged at once, the next ones at most once an interval, each line
// counting the timeouts since the last.
func TestSlowStoreLogger(t *testing.T) {
	core, logs := observer.New(zap.WarnLevel)
	onSlow := slowStoreLogger(zap.New(core), 50*time.Millisecond)
	timeout := fmt.Errorf("%w: COMPARE_SET timeout after 2s", rendezvous.ErrTimeout)
	for range 3 {
		onSlow("next", timeout)
	}
	time.Sleep(60 * time.Millisecond)
	onSlow("keep-alive", timeout)
	var got []string
	for _, e := range logs.All() {
		got = append(got, fmt.Sprintf("%v %v", e.ContextMap()["op"], e.ContextMap()["timeouts"]))
	}
	if want := []string{"next 1", "keep-alive 3"}; !slices.Equal(got, want) {
		t.Errorf("logged %q, want %q", got, want)
	}
}
