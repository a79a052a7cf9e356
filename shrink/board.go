package shrink

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/gorunhq/gorun/rendezvous"
)

// DefaultPrefix is where a Board keeps its keys in the worker store.
const DefaultPrefix = "gorun/shrink"

// Board is the agreement's state in a store every agent and worker reaches
// (the worker store). Its layout, under the prefix:
//
//	epoch/<n>     the JSON Epoch n, written once (n ≥ 1)
//	ack/<n>       counter: survivors that have moved to epoch n
//	report/next   counter: notices filed so far
//	respawns      counter: lost slots the agents started again (heal),
//	              against the job's budget
//	report/<i>    the JSON Notice i (i ≥ 1): a failure Report, a Join
//	              (newcomers ready for lost slots), a Joined (a newcomer
//	              finished joining a grow epoch's group) or a Complete
//	              (every rank of a grow epoch acknowledged it)
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

const (
	reportNext  = "report/next"
	respawnsKey = "respawns"
)

// TakeRespawn counts one respawn of a lost slot against the job's budget
// of max and reports whether it is within it. Every agent counts on the
// same key, so the budget is the job's, whichever node respawns.
func (b *Board) TakeRespawn(ctx context.Context, max int) (n int, ok bool, err error) {
	c, err := b.store.Add(ctx, respawnsKey, 1)
	if err != nil {
		return 0, false, fmt.Errorf("shrink: count a respawn: %w", err)
	}
	return int(c), c <= int64(max), nil
}

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

// Latest returns the number of the latest epoch on the board, 0 when there
// is none: one check per epoch, for a worker or agent that comes late.
func (b *Board) Latest(ctx context.Context) (int, error) {
	for n := 1; ; n++ {
		ok, err := b.store.Check(ctx, epochKey(n))
		if err != nil {
			return 0, fmt.Errorf("shrink: look for epoch %d: %w", n, err)
		}
		if !ok {
			return n - 1, nil
		}
	}
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

// Arrive acknowledges epoch e for one rank that has moved to its group and,
// when e is a grow and this was its last rank, files the Complete notice
// that tells the coordinator the grow is done: whoever counts last says so,
// so nobody polls the counter.
func (b *Board) Arrive(ctx context.Context, e Epoch) error {
	n, err := b.Ack(ctx, e.Number)
	if err != nil || e.Action != ActionGrow || n != int64(e.WorldSize) {
		return err
	}
	_, err = b.file(ctx, Notice{Complete: &Complete{Epoch: e.Number, At: time.Now()}})
	return err
}

// Acks returns how many survivors have acknowledged epoch n.
func (b *Board) Acks(ctx context.Context, n int) (int64, error) {
	c, err := b.store.Add(ctx, ackKey(n), 0)
	if err != nil {
		return 0, fmt.Errorf("shrink: read acks of epoch %d: %w", n, err)
	}
	return c, nil
}

// Notice is one entry of the Board's log, the news every agent's Decider
// follows: exactly one of its fields is set.
type Notice struct {
	Failure  *Report   `json:"failure,omitempty"`
	Join     *Join     `json:"join,omitempty"`
	Joined   *Joined   `json:"joined,omitempty"`
	Complete *Complete `json:"complete,omitempty"`
}

// Complete says that every rank of grow epoch Epoch has acknowledged it:
// the grown group works, and later epochs build on it.
type Complete struct {
	Epoch int       `json:"epoch"`
	At    time.Time `json:"at"`
}

// Joined is a newcomer's word that it has finished joining the group of
// grow epoch Epoch, in launch slot Slot.
type Joined struct {
	Epoch int       `json:"epoch"`
	Slot  int       `json:"slot"`
	At    time.Time `json:"at"`
}

// File adds a failure report to the log and returns its index (1, 2, …).
func (b *Board) File(ctx context.Context, r Report) (int, error) {
	return b.file(ctx, Notice{Failure: &r})
}

// FileJoin adds a Join to the log and returns its index.
func (b *Board) FileJoin(ctx context.Context, j Join) (int, error) {
	return b.file(ctx, Notice{Join: &j})
}

// FileJoined adds a Joined to the log and returns its index.
func (b *Board) FileJoined(ctx context.Context, j Joined) (int, error) {
	return b.file(ctx, Notice{Joined: &j})
}

func (b *Board) file(ctx context.Context, n Notice) (int, error) {
	rec, err := json.Marshal(n)
	if err != nil {
		return 0, fmt.Errorf("shrink: encode notice: %w", err)
	}
	i, err := b.store.Add(ctx, reportNext, 1)
	if err != nil {
		return 0, fmt.Errorf("shrink: file notice: %w", err)
	}
	if err := b.store.Set(ctx, reportKey(int(i)), rec); err != nil {
		return 0, fmt.Errorf("shrink: file notice %d: %w", i, err)
	}
	return int(i), nil
}

// Notices returns the notices filed after index after, and the index of
// the last one returned (after, when there is none). A notice whose index
// was taken but whose body is not written yet ends the batch: it is read
// next time.
func (b *Board) Notices(ctx context.Context, after int) ([]Notice, int, error) {
	n, err := b.store.Add(ctx, reportNext, 0)
	if err != nil {
		return nil, after, fmt.Errorf("shrink: read notices: %w", err)
	}
	var out []Notice
	for i := after + 1; i <= int(n); i++ {
		ok, err := b.store.Check(ctx, reportKey(i))
		if err != nil {
			return out, i - 1, fmt.Errorf("shrink: read notice %d: %w", i, err)
		}
		if !ok {
			return out, i - 1, nil
		}
		no, err := b.readNotice(ctx, i)
		if err != nil {
			return out, i - 1, err
		}
		out = append(out, no)
	}
	return out, int(n), nil
}

// AwaitNotice blocks until notice i is filed and returns it: a store wait
// on its key, like Await.
func (b *Board) AwaitNotice(ctx context.Context, i int) (Notice, error) {
	key := reportKey(i)
	for {
		err := b.store.Wait(ctx, key)
		if err == nil {
			break
		}
		if !errors.Is(err, rendezvous.ErrTimeout) || ctx.Err() != nil {
			return Notice{}, fmt.Errorf("shrink: await notice %d: %w", i, err)
		}
	}
	return b.readNotice(ctx, i)
}

func (b *Board) readNotice(ctx context.Context, i int) (Notice, error) {
	rec, err := b.store.Get(ctx, reportKey(i))
	if err != nil {
		return Notice{}, fmt.Errorf("shrink: read notice %d: %w", i, err)
	}
	var n Notice
	if err := json.Unmarshal(rec, &n); err != nil {
		return Notice{}, fmt.Errorf("shrink: notice %d: %w", i, err)
	}
	set := 0
	for _, present := range []bool{n.Failure != nil, n.Join != nil, n.Joined != nil, n.Complete != nil} {
		if present {
			set++
		}
	}
	if set != 1 {
		return Notice{}, fmt.Errorf("shrink: notice %d: want exactly one of failure, join, joined, complete: %s", i, rec)
	}
	return n, nil
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
