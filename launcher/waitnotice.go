package launcher

import (
	"context"
	"time"

	"go.uber.org/zap"
)

// waitNoticeEvery is how often a long wait says again what it waits for.
const waitNoticeEvery = 5 * time.Second

// announceWait says what the agent waits for — now, and again every
// waitNoticeEvery with the time waited and the time left before deadline
// (zero: no deadline) — until stop is called. An operator looking at a pod
// that sits there learns why, and a stop signal's log line that follows
// says what it interrupted.
func announceWait(log *zap.Logger, what string, deadline time.Time, fields ...zap.Field) (stop func()) {
	return announceWaitAfter(log, 0, what, deadline, fields...)
}

// announceWaitAfter is announceWait for a wait that is short but for a
// loaded peer: it says nothing until the wait has lasted quiet.
func announceWaitAfter(log *zap.Logger, quiet time.Duration, what string, deadline time.Time, fields ...zap.Field) (stop func()) {
	began := time.Now()
	notice := func(msg string) {
		fs := append([]zap.Field{zap.Duration("waited", time.Since(began).Round(time.Second))}, fields...)
		if !deadline.IsZero() {
			fs = append(fs, zap.Duration("left", time.Until(deadline).Round(time.Second)))
		}
		log.Info(msg, fs...)
	}
	if quiet <= 0 {
		log.Info("waiting for "+what, fields...)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		if quiet > 0 {
			t := time.NewTimer(quiet)
			select {
			case <-ctx.Done():
				t.Stop()
				return
			case <-t.C:
			}
			notice("waiting for " + what)
		}
		t := time.NewTicker(waitNoticeEvery)
		defer t.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case <-t.C:
				notice("still waiting for " + what)
			}
		}
	}()
	return func() {
		cancel()
		<-done
	}
}
