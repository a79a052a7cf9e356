package shrink

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"

	"github.com/gorunhq/gorun/rendezvous"
)

// DefaultPrefix is where a Board keeps its keys in the worker store.
const DefaultPrefix = "gorun/shrink"

// Board is the agreement's state in a store every agent and worker reaches
// (the worker store). Its layout, under the prefix:
//
//	epoch/<n>     the JSON Epoch n, written once (n ≥ 1)
//	ack/<n>       counter: survivors that have moved to epoch n
//	report/next   counter: failure reports filed so far
//	report/<i>    the JSON Report i (i ≥ 1)
//
// Only Set, Get, Add, CompareSet, Check and Wait are used, so a Board works
// on any c10d store: gorun's, PyTorch's (1.13 included) and a FileStore.
type Board struct {
	store rendezvous.Store
}

// NewBoard returns a Board on s under prefix (DefaultPrefix when empty).
// The Board does not own s.
func NewBoard(s rendezvous.Store, prefix string) *Board {
	if prefix == "" {
		prefix = DefaultPrefix
	}
	return &Board{store: rendezvous.NewPrefixStore(prefix, s)}
}

func epochKey(n int) string  { return "epoch/" + strconv.Itoa(n) }
func ackKey(n int) string    { return "ack/" + strconv.Itoa(n) }
func reportKey(i int) string { return "report/" + strconv.Itoa(i) }

const reportNext = "report/next"

// Publish writes e as epoch e.Number unless one is there already: a
// compare-set that only creates, so of two racing coordinators exactly one
// wins. It returns the epoch the board holds afterwards — e, or the
// winner's — and whether it was e.
func (b *Board) Publish(ctx context.Context, e Epoch) (Epoch, bool, error) {
	if e.Number < 1 {
		return Epoch{}, false, fmt.Errorf("shrink: publish epoch %d: epochs on the board start at 1", e.Number)
	}
	rec, err := json.Marshal(e)
	if err != nil {
		return Epoch{}, false, fmt.Errorf("shrink: encode epoch %d: %w", e.Number, err)
	}
	got, err := b.store.CompareSet(ctx, epochKey(e.Number), nil, rec)
	if err != nil {
		return Epoch{}, false, fmt.Errorf("shrink: publish epoch %d: %w", e.Number, err)
	}
	if bytes.Equal(got, rec) {
		return e, true, nil
	}
	held, err := decodeEpoch(e.Number, got)
	return held, false, err
}

// Await blocks until epoch n is on the board and returns it. It waits
// through the store (a Wait on the key), not by polling; a store whose own
// timeout ends a wait is asked again until ctx is done.
func (b *Board) Await(ctx context.Context, n int) (Epoch, error) {
	key := epochKey(n)
	for {
		err := b.store.Wait(ctx, key)
		if err == nil {
			break
		}
		if !errors.Is(err, rendezvous.ErrTimeout) || ctx.Err() != nil {
			return Epoch{}, fmt.Errorf("shrink: await epoch %d: %w", n, err)
		}
	}
	rec, err := b.store.Get(ctx, key)
	if err != nil {
		return Epoch{}, fmt.Errorf("shrink: read epoch %d: %w", n, err)
	}
	return decodeEpoch(n, rec)
}

// Lookup returns epoch n if it is on the board, without waiting.
func (b *Board) Lookup(ctx context.Context, n int) (Epoch, bool, error) {
	ok, err := b.store.Check(ctx, epochKey(n))
	if err != nil || !ok {
		return Epoch{}, false, err
	}
	e, err := b.Await(ctx, n)
	return e, err == nil, err
}

// Ack records that one survivor has moved to epoch n and returns how many
// have.
func (b *Board) Ack(ctx context.Context, n int) (int64, error) {
	c, err := b.store.Add(ctx, ackKey(n), 1)
	if err != nil {
		return 0, fmt.Errorf("shrink: ack epoch %d: %w", n, err)
	}
	return c, nil
}

// Acks returns how many survivors have acknowledged epoch n.
func (b *Board) Acks(ctx context.Context, n int) (int64, error) {
	c, err := b.store.Add(ctx, ackKey(n), 0)
	if err != nil {
		return 0, fmt.Errorf("shrink: read acks of epoch %d: %w", n, err)
	}
	return c, nil
}

// File adds a failure report and returns its index (1, 2, …).
func (b *Board) File(ctx context.Context, r Report) (int, error) {
	rec, err := json.Marshal(r)
	if err != nil {
		return 0, fmt.Errorf("shrink: encode report: %w", err)
	}
	i, err := b.store.Add(ctx, reportNext, 1)
	if err != nil {
		return 0, fmt.Errorf("shrink: file report: %w", err)
	}
	if err := b.store.Set(ctx, reportKey(int(i)), rec); err != nil {
		return 0, fmt.Errorf("shrink: file report %d: %w", i, err)
	}
	return int(i), nil
}

// Reports returns the reports filed after index after, and the index of
// the last one returned (after, when there is none). A report whose index
// was taken but whose body is not written yet ends the batch: it is read
// next time.
func (b *Board) Reports(ctx context.Context, after int) ([]Report, int, error) {
	n, err := b.store.Add(ctx, reportNext, 0)
	if err != nil {
		return nil, after, fmt.Errorf("shrink: read reports: %w", err)
	}
	var out []Report
	for i := after + 1; i <= int(n); i++ {
		ok, err := b.store.Check(ctx, reportKey(i))
		if err != nil {
			return out, i - 1, fmt.Errorf("shrink: read report %d: %w", i, err)
		}
		if !ok {
			return out, i - 1, nil
		}
		rec, err := b.store.Get(ctx, reportKey(i))
		if err != nil {
			return out, i - 1, fmt.Errorf("shrink: read report %d: %w", i, err)
		}
		var r Report
		if err := json.Unmarshal(rec, &r); err != nil {
			return out, i - 1, fmt.Errorf("shrink: report %d: %w", i, err)
		}
		out = append(out, r)
	}
	return out, int(n), nil
}

// AwaitReport blocks until report i is filed and returns it: a store wait
// on its key, like Await.
func (b *Board) AwaitReport(ctx context.Context, i int) (Report, error) {
	key := reportKey(i)
	for {
		err := b.store.Wait(ctx, key)
		if err == nil {
			break
		}
		if !errors.Is(err, rendezvous.ErrTimeout) || ctx.Err() != nil {
			return Report{}, fmt.Errorf("shrink: await report %d: %w", i, err)
		}
	}
	rec, err := b.store.Get(ctx, key)
	if err != nil {
		return Report{}, fmt.Errorf("shrink: read report %d: %w", i, err)
	}
	var r Report
	if err := json.Unmarshal(rec, &r); err != nil {
		return Report{}, fmt.Errorf("shrink: report %d: %w", i, err)
	}
	return r, nil
}

func decodeEpoch(n int, rec []byte) (Epoch, error) {
	var e Epoch
	if err := json.Unmarshal(rec, &e); err != nil {
		return Epoch{}, fmt.Errorf("shrink: epoch %d on the board: %w", n, err)
	}
	if e.Number != n {
		return Epoch{}, fmt.Errorf("shrink: key of epoch %d holds epoch %d", n, e.Number)
	}
	return e, nil
}
