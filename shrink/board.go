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
//	floor         the JSON Floor: where the history kept starts; the
//	              records a generation below it are collected
//
// Only Set, Get, Add, CompareSet, Check and Wait are used, so a Board works
// on any c10d store: gorun's, PyTorch's (1.13 included) and a FileStore.
//
// Anyone who reaches the store can write to it. An authenticated Board
// (Authenticated) seals the records it writes (epochs, notices) with a MAC
// under the job secret and refuses those it reads without a valid one: a
// forged or replayed epoch is never returned (readers wait on for the
// genuine one), a forged notice is skipped, and each is reported once to
// the Auth's onForged. The counters (acks, report/next, respawns) carry no
// MAC: a store's Add cannot.
type Board struct {
	store rendezvous.Store // under the prefix
	raw   rendezvous.Store // the whole store: epochs' formation keys (Raise)
	auth  *Auth            // nil: records are neither sealed nor verified
}

// NewBoard returns a Board on s under prefix (DefaultPrefix when empty).
// The Board does not own s.
func NewBoard(s rendezvous.Store, prefix string) *Board {
	if prefix == "" {
		prefix = DefaultPrefix
	}
	return &Board{store: rendezvous.NewPrefixStore(prefix, s), raw: s}
}

// Authenticated returns a Board on b's store and prefix that seals what it
// writes and verifies what it reads with a. A nil a returns b itself: the
// job has no secret, and nothing is sealed or verified.
func (b *Board) Authenticated(a *Auth) *Board {
	if a == nil {
		return b
	}
	return &Board{store: b.store, raw: b.raw, auth: a}
}

// forgedPoll is how often a reader looks again at a key that holds a forged
// record, for the genuine one that replaces it: a store wait returns at
// once on a key that exists, so this polls, only while under attack.
const forgedPoll = 50 * time.Millisecond

// noticeGrace is how long a reader of notice i that finds a forged record
// there, once index i has been taken, waits for the genuine notice to
// replace it before skipping it. A filer writes its notice right after
// taking the index, so a forgery written ahead of it is replaced within
// a store round trip; one under an index the forger took itself never is.
const noticeGrace = time.Second

// seal returns rec, sealed for key when the Board is authenticated.
func (b *Board) seal(key string, rec []byte) ([]byte, error) {
	if b.auth == nil {
		return rec, nil
	}
	return b.auth.seal(key, rec)
}

// open returns the body of rec, read at key: rec itself when the Board is
// not authenticated, and a Forgery when it is and rec fails.
func (b *Board) open(key string, rec []byte) ([]byte, error) {
	if b.auth == nil {
		return rec, nil
	}
	return b.auth.open(key, rec)
}

// pause waits d, or until ctx is done.
func pause(ctx context.Context, d time.Duration) error {
	select {
	case <-ctx.Done():
		return context.Cause(ctx)
	case <-time.After(d): // a timer not fired is collected (Go 1.23)
		return nil
	}
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
// winner's — and whether it was e. On an authenticated Board a forged
// record under the key does not count as there: it is replaced by a
// compare-set from its very bytes, so a genuine rival's epoch, written
// meanwhile, is still never overwritten.
func (b *Board) Publish(ctx context.Context, e Epoch) (Epoch, bool, error) {
	if e.Number < 1 {
		return Epoch{}, false, fmt.Errorf("shrink: publish epoch %d: epochs on the board start at 1", e.Number)
	}
	key := epochKey(e.Number)
	rec, err := json.Marshal(e)
	if err == nil {
		rec, err = b.seal(key, rec)
	}
	if err != nil {
		return Epoch{}, false, fmt.Errorf("shrink: encode epoch %d: %w", e.Number, err)
	}
	var expected []byte // nil: create only
	for {
		got, err := b.store.CompareSet(ctx, key, expected, rec)
		if err != nil {
			return Epoch{}, false, fmt.Errorf("shrink: publish epoch %d: %w", e.Number, err)
		}
		if bytes.Equal(got, rec) {
			return e, true, nil
		}
		held, err := b.decodeEpoch(e.Number, got)
		if !errors.Is(err, ErrForged) {
			return held, false, err
		}
		if bytes.Equal(got, expected) {
			// c10d's quirk: the key is gone (an absent key with a
			// non-empty expected answers expected). Create it again.
			expected = nil
		} else {
			expected = got
		}
		if err := ctx.Err(); err != nil {
			return Epoch{}, false, fmt.Errorf("shrink: publish epoch %d over a forged record: %w", e.Number, err)
		}
	}
}

// Await blocks until epoch n is on the board and returns it. It waits
// through the store (a Wait on the key), not by polling; a store whose own
// timeout ends a wait is asked again until ctx is done. An epoch collected
// below the Floor gives ErrCollected. On an
// authenticated Board a forged record under the key is not returned: Await
// waits on, looking again every forgedPoll, until the genuine epoch
// replaces it.
func (b *Board) Await(ctx context.Context, n int) (Epoch, error) {
	key := epochKey(n)
	if err := b.waitKept(ctx, key, func(f Floor) bool { return f.collected(n) }); err != nil {
		return Epoch{}, fmt.Errorf("shrink: await epoch %d: %w", n, err)
	}
	for {
		rec, err := b.store.Get(ctx, key)
		if err != nil {
			return Epoch{}, fmt.Errorf("shrink: read epoch %d: %w", n, err)
		}
		e, err := b.decodeEpoch(n, rec)
		if !errors.Is(err, ErrForged) {
			return e, err
		}
		if perr := pause(ctx, forgedPoll); perr != nil {
			return Epoch{}, fmt.Errorf("shrink: await epoch %d: %w (the key holds a forged record: %w)", n, perr, err)
		}
	}
}

// waitKept waits until key exists; a store whose own timeout ends a wait
// is asked again until ctx is done. A key the Floor says was collected
// (gone) gives ErrCollected instead: the Floor is looked at when the key is
// not there at first, and again each time the store's timeout ends a wait,
// so a reader that fell behind is told within that timeout.
func (b *Board) waitKept(ctx context.Context, key string, gone func(Floor) bool) error {
	ok, err := b.store.Check(ctx, key)
	if err != nil || ok {
		return err
	}
	for {
		f, err := b.Floor(ctx)
		if err != nil {
			return err
		}
		if gone(f) {
			return fmt.Errorf("%s: %w (floor at epoch %d, notice %d)", key, ErrCollected, f.Epoch, f.Notice)
		}
		err = b.store.Wait(ctx, key)
		if err == nil {
			return nil
		}
		if !errors.Is(err, rendezvous.ErrTimeout) || ctx.Err() != nil {
			return err
		}
	}
}

// Latest returns the number of the latest epoch on the board, 0 when there
// is none: one check per epoch from the Floor's, for a worker or agent that
// comes late. On an authenticated Board each epoch is read and verified,
// and the first one that is not genuine ends the count.
func (b *Board) Latest(ctx context.Context) (int, error) {
	f, err := b.Floor(ctx)
	if err != nil {
		return 0, err
	}
	for n := max(f.Epoch, 1); ; n++ {
		_, ok, err := b.lookup(ctx, n, b.auth != nil)
		if err != nil {
			return 0, fmt.Errorf("shrink: look for epoch %d: %w", n, err)
		}
		if !ok {
			return n - 1, nil
		}
	}
}

// Lookup returns epoch n if it is on the board, without waiting. A forged
// record under its key counts as no epoch.
func (b *Board) Lookup(ctx context.Context, n int) (Epoch, bool, error) {
	return b.lookup(ctx, n, true)
}

// lookup reports whether epoch n is on the board and, with read, returns
// it: without, a key that exists counts.
func (b *Board) lookup(ctx context.Context, n int, read bool) (Epoch, bool, error) {
	key := epochKey(n)
	ok, err := b.store.Check(ctx, key)
	if err != nil || !ok || !read {
		return Epoch{}, ok, err
	}
	rec, err := b.store.Get(ctx, key)
	if err != nil {
		return Epoch{}, false, fmt.Errorf("shrink: read epoch %d: %w", n, err)
	}
	e, err := b.decodeEpoch(n, rec)
	switch {
	case errors.Is(err, ErrForged):
		return Epoch{}, false, nil
	case err != nil:
		return Epoch{}, false, err
	}
	return e, true, nil
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
	// Sealed for its key, which is known only now.
	if rec, err = b.seal(reportKey(int(i)), rec); err != nil {
		return 0, fmt.Errorf("shrink: encode notice %d: %w", i, err)
	}
	if err := b.store.Set(ctx, reportKey(int(i)), rec); err != nil {
		return 0, fmt.Errorf("shrink: file notice %d: %w", i, err)
	}
	return int(i), nil
}

// Notices returns the notices filed after index after, and the index of
// the last one returned (after, when there is none). A notice whose index
// was taken but whose body is not written yet ends the batch: it is read
// next time. On an authenticated Board forged notices are skipped, at once:
// a genuine notice whose filer has taken its index but not yet replaced a
// forgery written ahead of it is missed, so a reader that must see every
// notice follows the log with AwaitNotice, which waits for it. Notices
// collected below the Floor are not returned.
func (b *Board) Notices(ctx context.Context, after int) ([]Notice, int, error) {
	n, err := b.store.Add(ctx, reportNext, 0)
	if err != nil {
		return nil, after, fmt.Errorf("shrink: read notices: %w", err)
	}
	f, err := b.Floor(ctx)
	if err != nil {
		return nil, after, err
	}
	var out []Notice
	for i := max(after, f.SweptNotice) + 1; i <= int(n); i++ {
		ok, err := b.store.Check(ctx, reportKey(i))
		if err != nil {
			return out, i - 1, fmt.Errorf("shrink: read notice %d: %w", i, err)
		}
		if !ok {
			return out, i - 1, nil
		}
		no, err := b.readNotice(ctx, i)
		if errors.Is(err, ErrForged) {
			continue // reported by the Auth
		}
		if err != nil {
			return out, i - 1, err
		}
		out = append(out, no)
	}
	return out, int(n), nil
}

// AwaitNotice blocks until notice i is filed and returns it: a store wait
// on its key, like Await, and ErrCollected for a notice collected below
// the Floor. On an authenticated Board a forged record under
// the key is waited past while index i is not taken yet (a forgery written
// ahead of the genuine notice, which replaces it) and for noticeGrace once
// it is; if still forged then, AwaitNotice returns its Forgery (wrapping
// ErrForged) and the caller moves on to i+1.
func (b *Board) AwaitNotice(ctx context.Context, i int) (Notice, error) {
	if err := b.awaitNoticeKey(ctx, i); err != nil {
		return Notice{}, fmt.Errorf("shrink: await notice %d: %w", i, err)
	}
	var giveUp time.Time
	for {
		n, err := b.readNotice(ctx, i)
		if !errors.Is(err, ErrForged) {
			return n, err
		}
		taken, aerr := b.store.Add(ctx, reportNext, 0)
		if aerr != nil {
			return Notice{}, fmt.Errorf("shrink: read notices: %w", aerr)
		}
		if taken >= int64(i) {
			if giveUp.IsZero() {
				giveUp = time.Now().Add(noticeGrace)
			} else if time.Now().After(giveUp) {
				return Notice{}, err
			}
		}
		if perr := pause(ctx, forgedPoll); perr != nil {
			return Notice{}, fmt.Errorf("shrink: await notice %d: %w (the key holds a forged record: %w)", i, perr, err)
		}
	}
}

// ErrAbandoned: a notice's index was taken and its record never written:
// its filer died between the two (a newcomer killed as it said it was
// ready). The log goes on past it.
var ErrAbandoned = errors.New("notice abandoned by its filer")

// noticeLook is how long a reader of the notice log waits on a notice's
// key before it looks whether a later index was taken (see
// awaitNoticeKey): a few requests per reader every noticeLook while the
// log is quiet.
const noticeLook = 5 * time.Second

// awaitNoticeKey waits until notice i's key exists, in slices of
// noticeLook: a filer writes its notice right after taking its index, so
// once a later index is taken, notice i still missing noticeGrace later
// is abandoned (ErrAbandoned), and the log does not wait on it for ever.
func (b *Board) awaitNoticeKey(ctx context.Context, i int) error {
	gone := func(f Floor) bool { return f.noticeCollected(i) }
	overtaken := false
	for {
		slice := noticeLook
		if overtaken {
			slice = noticeGrace
		}
		wctx, cancel := context.WithTimeout(ctx, slice)
		err := b.waitKept(wctx, reportKey(i), gone)
		// The store may time a request out at the slice's deadline a
		// moment before the context says so.
		sliceOver := wctx.Err() != nil || errors.Is(err, context.DeadlineExceeded) || errors.Is(err, rendezvous.ErrTimeout)
		cancel()
		if err == nil || ctx.Err() != nil || !sliceOver {
			return err
		}
		taken, aerr := b.store.Add(ctx, reportNext, 0)
		if aerr != nil {
			return fmt.Errorf("read notices: %w", aerr)
		}
		if taken > int64(i) {
			if overtaken {
				return fmt.Errorf("index %d of %d: %w", i, taken, ErrAbandoned)
			}
			overtaken = true
		}
	}
}

func (b *Board) readNotice(ctx context.Context, i int) (Notice, error) {
	key := reportKey(i)
	rec, err := b.store.Get(ctx, key)
	if err != nil {
		return Notice{}, fmt.Errorf("shrink: read notice %d: %w", i, err)
	}
	if rec, err = b.open(key, rec); err != nil {
		return Notice{}, err
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

// decodeEpoch returns the epoch in rec, read at epoch n's key: on an
// authenticated Board a Forgery unless rec is genuine.
func (b *Board) decodeEpoch(n int, rec []byte) (Epoch, error) {
	rec, err := b.open(epochKey(n), rec)
	if err != nil {
		return Epoch{}, err
	}
	var e Epoch
	if err := json.Unmarshal(rec, &e); err != nil {
		return Epoch{}, fmt.Errorf("shrink: epoch %d on the board: %w", n, err)
	}
	if e.Number != n {
		return Epoch{}, fmt.Errorf("shrink: key of epoch %d holds epoch %d", n, e.Number)
	}
	return e, nil
}
