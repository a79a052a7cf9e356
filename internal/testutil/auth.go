package testutil

import (
	"sync"
	"testing"

	"github.com/gorunhq/gorun/shrink"
)

// RecordingAuth returns a shrink.Auth under secret for the round scope
// that records every forgery its Boards refuse, and a function that
// returns them, by key.
func RecordingAuth(t testing.TB, secret, scope string) (*shrink.Auth, func() map[string]shrink.ForgeryReason) {
	t.Helper()
	var mu sync.Mutex
	forged := map[string]shrink.ForgeryReason{}
	a, err := shrink.NewAuth([]byte(secret), scope, func(f shrink.Forgery) {
		mu.Lock()
		defer mu.Unlock()
		forged[f.Key] = f.Reason
	})
	if err != nil {
		t.Fatal(err)
	}
	return a, func() map[string]shrink.ForgeryReason {
		mu.Lock()
		defer mu.Unlock()
		out := make(map[string]shrink.ForgeryReason, len(forged))
		for k, v := range forged {
			out[k] = v
		}
		return out
	}
}
