package shrink

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"sync/atomic"
	"time"

	"github.com/gorunhq/gorun/rendezvous"
)

// DefaultPrefix is where a Board keeps its keys in the worker store.
const DefaultPrefix = "gorun/shrink"

// Board is the agreement's state in a store every agent and worker reaches
// (the worker store). Its layout, under the prefix:
//
//	epoch/<n>       the JSON Epoch n, written once (n ≥ 1)
//	ack/<n>/<g>     the JSON Ack: launch slot g has moved to epoch n
//	ack/<n>         counter: how many have (a hint, see Arrive)
//	report/<i>      the JSON Notice i (i ≥ 1), written once: a failure
//	                Report, a Join (newcomers ready for lost slots), a
//	                Joined (a newcomer finished joining a grow epoch's
//	                group) or a Complete (every rank of a grow epoch
//	                acknowledged it)
//	respawns/<k>    the JSON Ticket k (1 ≤ k ≤ the job's budget), written
//	                once: the k-th lost slot the agents started again;
//	                collected, like the rest, a generation below the floor
//	floor           the JSON Floor: where the history kept starts; the
//	                records a generation below it are collected
//
// Only Set, Get, Add, CompareSet, Check and Wait are used, so a Board works
// on any c10d store: gorun's, PyTorch's (1.13 included) and a FileStore.
//
// Anyone who reaches the store can write to it. An authenticated Board
// (Authenticated) seals the records it writes (epochs, notices, acks,
// tickets) with a MAC under the job secret and refuses those it reads
// without a valid one: a forged or replayed epoch is never returned
// (readers wait on for the genuine one), a forged notice is skipped, a
// forged ack or ticket does not count, and each is reported once to the
// Auth's onForged. Nothing the Board acts on is a counter, which a store's
// Add could not seal: the log's indices and the tickets are taken by
// create-only compare-sets, and the ack counter only says when to look at
// the sealed acks.
type Board struct {
	store rendezvous.Store // under the prefix
	raw   rendezvous.Store // the whole store: epochs' formation keys (Raise)
	auth  *Auth            // nil: records are neither sealed nor verified
	// Hints of where the log and the tickets stand, as far as this Board
	// has seen: where a filer starts looking for a free index.
	notices, tickets atomic.Int64
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

func epochKey(n int) string { return "epoch/" + strconv.Itoa(n) }
func ackKey(n int) string   { return "ack/" + strconv.Itoa(n) }
func memberAckKey(n, g int) string {
	return "ack/" + strconv.Itoa(n) + "/" + strconv.Itoa(g)
}
func reportKey(i int) string { return "report/" + strconv.Itoa(i) }
func ticketKey(k int) string { return "respawns/" + strconv.Itoa(k) }

// Ticket is one respawn counted against the job's budget.
type Ticket struct {
	Number int       `json:"ticket"`
	At     time.Time `json:"at"`
}

// TakeRespawn takes one of the job's budget of respawn tickets and reports
// whether one was left; n is its number. Every agent takes from the same
// keys, so the budget is the job's, whichever node respawns. A ticket is a
// create-only compare-set: a forged one is taken over (it does not spend
// the budget), and racing agents never take the same one. The tickets the
// Floor counts as taken are collected a generation later (Floor.Tickets),
// so a taker starts after the floor's count: its key may be gone.
func (b *Board) TakeRespawn(ctx context.Context, budget int) (n int, ok bool, err error) {
	f, err := b.Floor(ctx)
	if err != nil {
		return 0, false, fmt.Errorf("shrink: take a respawn ticket: %w", err)
	}
	for k := max(int(b.tickets.Load()), f.Tickets) + 1; k <= budget; k++ {
		key := ticketKey(k)
		rec, err := json.Marshal(Ticket{Number: k, At: time.Now()})
		if err == nil {
			rec, err = b.seal(key, rec)
		}
		if err != nil {
			return 0, false, fmt.Errorf("shrink: encode respawn ticket %d: %w", k, err)
		}
		_, won, err := b.claim(ctx, key, rec, func(got []byte) bool {
			_, err := b.open(key, got)
			return errors.Is(err, ErrForged)
		})
		if err != nil {
			return 0, false, fmt.Errorf("shrink: take respawn ticket %d: %w", k, err)
		}
		b.tickets.Store(int64(k))
		if won {
			return k, true, nil
		}
	}
	return budget + 1, false, nil
}

// claim writes rec at key unless a record is there already: a compare-set
// that only creates, or that replaces a record forged says is forged (from
// its very bytes, so that a genuine rival written meanwhile is never
// overwritten). It returns the record the key holds afterwards and
// whether it is rec.
func (b *Board) claim(ctx context.Context, key string, rec []byte, forged func([]byte) bool) ([]byte, bool, error) {
	var expected []byte // nil: create only
	for {
		got, err := b.store.CompareSet(ctx, key, expected, rec)
		if err != nil {
			return nil, false, err
		}
		if bytes.Equal(got, rec) {
			return got, true, nil
		}
		if !forged(got) {
			return got, false, nil
		}
		if bytes.Equal(got, expected) {
			// c10d's quirk: the key is gone (an absent key with a
			// non-empty expected answers expected). Create it again.
			expected = nil
		} else {
			expected = got
		}
		if err := ctx.Err(); err != nil {
			return nil, false, fmt.Errorf("%s holds a forged record: %w", key, err)
		}
	}
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
	got, won, err := b.claim(ctx, key, rec, func(got []byte) bool {
		_, err := b.decodeEpoch(e.Number, got)
		return errors.Is(err, ErrForged)
	})
	if err != nil {
		return Epoch{}, false, fmt.Errorf("shrink: publish epoch %d: %w", e.Number, err)
	}
	if won {
		return e, true, nil
	}
	held, err := b.decodeEpoch(e.Number, got)
	return held, false, err
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
// is asked again until ctx is done, and so is one whose timeout ends a
// look at the key or the Floor (askAgain). A key the Floor says was
// collected (gone) gives ErrCollected instead: the Floor is looked at when
// the key is not there at first, and again each time the store's timeout
// ends a wait, so a reader that fell behind is told within that timeout.
func (b *Board) waitKept(ctx context.Context, key string, gone func(Floor) bool) error {
	ok, err := askAgain(ctx, func() (bool, error) { return b.store.Check(ctx, key) })
	if err != nil || ok {
		return err
	}
	for {
		f, err := askAgain(ctx, func() (Floor, error) { return b.Floor(ctx) })
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

// askAgainPause is how long askAgain waits between tries.
const askAgainPause = 50 * time.Millisecond

// askAgain calls look until it returns anything but a slow store's timeout
// (rendezvous.SlowStore: no answer in the store's time, a reconnect that
// timed out with nothing refusing it), or ctx is done. It serves the waits that last as long as the
// round (the watchers of epochs and notices): a link cut for a few seconds
// times their looks out, and a failed watcher ended the agreement, every
// rank of its node restarted (bench/chaos, a 4-s cut, "await epoch 1:
// read the board's floor: … CHECK: timeout after 10s"). A stall that
// matters is bounded elsewhere: the Coordinator gives up on what is
// pending after its AgreementTimeout. A store that is gone (refused,
// reset, closed) is not slow: its error returns at once.
func askAgain[T any](ctx context.Context, look func() (T, error)) (T, error) {
	for {
		v, err := look()
		if err == nil || !rendezvous.SlowStore(err) || ctx.Err() != nil {
			return v, err
		}
		if pause(ctx, askAgainPause) != nil {
			return v, err
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

// Ack is a member's acknowledgement of an epoch: launch slot Slot has
// moved to epoch Epoch's group.
type Ack struct {
	Epoch int `json:"epoch"`
	Slot  int `json:"slot"`
}

// Arrive acknowledges epoch e for launch slot g, a rank that has moved to
// its group, and, when e is a grow and every rank has, files the Complete
// notice that tells the coordinator the grow is done. The sealed ack is
// what counts; the counter beside it only says when to look: whoever
// counts up to the world size reads every member's ack and, when all are
// there and genuine, files Complete. A count tampered with upwards costs
// early looks; one tampered with downwards, or a last member that dies
// before it files, leaves the grow to the coordinator's look at its
// GrowTimeout (Coordinator, Arrived).
func (b *Board) Arrive(ctx context.Context, e Epoch, g int) error {
	key := memberAckKey(e.Number, g)
	rec, err := json.Marshal(Ack{Epoch: e.Number, Slot: g})
	if err == nil {
		rec, err = b.seal(key, rec)
	}
	if err != nil {
		return fmt.Errorf("shrink: encode the ack of epoch %d: %w", e.Number, err)
	}
	if err := b.store.Set(ctx, key, rec); err != nil {
		return fmt.Errorf("shrink: ack epoch %d: %w", e.Number, err)
	}
	n, err := b.store.Add(ctx, ackKey(e.Number), 1)
	if err != nil {
		return fmt.Errorf("shrink: ack epoch %d: %w", e.Number, err)
	}
	if e.Action != ActionGrow || n < int64(e.WorldSize) {
		return nil
	}
	all, err := b.Arrived(ctx, e)
	if err != nil || !all {
		return err
	}
	_, err = b.file(ctx, Notice{Complete: &Complete{Epoch: e.Number, At: time.Now()}})
	return err
}

// Arrived reports whether every member of epoch e has acknowledged it
// with a genuine ack.
func (b *Board) Arrived(ctx context.Context, e Epoch) (bool, error) {
	var keys []string
	for g, r := range e.Ranks {
		if r >= 0 {
			keys = append(keys, memberAckKey(e.Number, g))
		}
	}
	if len(keys) == 0 {
		return true, nil
	}
	ok, err := b.store.Check(ctx, keys...)
	if err != nil || !ok || b.auth == nil {
		return ok, err
	}
	for _, key := range keys {
		rec, err := b.store.Get(ctx, key)
		if err != nil {
			return false, fmt.Errorf("shrink: read %s: %w", key, err)
		}
		if _, err := b.open(key, rec); err != nil {
			return false, nil
		}
	}
	return true, nil
}

// Acks returns how many survivors have acknowledged epoch n, by the
// counter: a hint (see Arrive).
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

// file adds n to the log at the first free index and returns it. An
// index is taken with its record, by a compare-set that only creates, so
// the log has no holes and no counter to tamper with; an index that holds
// a forgery is passed over (readers skip it). The search starts above
// what this Board has seen and above the Floor's notice. The Floor only
// collects notices up to one a leader has read, in order, so a notice
// found after filing to lie above what the Floor says is swept was read
// before it could be collected, even when the Floor's notice is this one.
func (b *Board) file(ctx context.Context, n Notice) (int, error) {
	body, err := json.Marshal(n)
	if err != nil {
		return 0, fmt.Errorf("shrink: encode notice: %w", err)
	}
	f, err := b.Floor(ctx)
	if err != nil {
		return 0, err
	}
	for i := max(int(b.notices.Load()), f.Notice) + 1; ; i++ {
		key := reportKey(i)
		rec, err := b.seal(key, body) // sealed for its key
		if err != nil {
			return 0, fmt.Errorf("shrink: encode notice %d: %w", i, err)
		}
		got, err := b.store.CompareSet(ctx, key, nil, rec)
		if err != nil {
			return 0, fmt.Errorf("shrink: file notice %d: %w", i, err)
		}
		if !bytes.Equal(got, rec) {
			continue // taken
		}
		if f, err = b.Floor(ctx); err != nil {
			return 0, err
		}
		if f.noticeCollected(i) {
			// The index was free because a sweep had emptied it (the
			// Floor rose twice since it was read): readers skip it, so
			// file it again above. An index at or below f.Notice but not
			// swept was free when taken, so the log reached it: the
			// floor settled this very notice (a Complete the leader read
			// at once) and filing it again would say it twice. The copy
			// left below goes now: no later sweep reaches back to it.
			if _, err := b.store.Delete(ctx, key); err != nil {
				return 0, fmt.Errorf("shrink: withdraw notice %d below the floor: %w", i, err)
			}
			i = f.Notice
			continue
		}
		b.seen(i)
		return i, nil
	}
}

// seen records that notice i exists.
func (b *Board) seen(i int) {
	for {
		cur := b.notices.Load()
		if int64(i) <= cur || b.notices.CompareAndSwap(cur, int64(i)) {
			return
		}
	}
}

// Notices returns the notices filed after index after, and the index of
// the last one returned (after, when there is none): every notice up to
// the first free index. On an authenticated Board forged notices are
// skipped. Notices collected below the Floor are not returned.
func (b *Board) Notices(ctx context.Context, after int) ([]Notice, int, error) {
	f, err := b.Floor(ctx)
	if err != nil {
		return nil, after, err
	}
	var out []Notice
	for i := max(after, f.SweptNotice) + 1; ; i++ {
		ok, err := b.store.Check(ctx, reportKey(i))
		if err != nil {
			return out, i - 1, fmt.Errorf("shrink: read notice %d: %w", i, err)
		}
		if !ok {
			return out, max(after, i-1), nil
		}
		b.seen(i)
		no, err := b.readNotice(ctx, i)
		if errors.Is(err, ErrForged) {
			continue // reported by the Auth
		}
		if err != nil {
			return out, i - 1, err
		}
		out = append(out, no)
	}
}

// AwaitNotice blocks until notice i is filed and returns it: a store wait
// on its key, like Await, and ErrCollected for a notice collected below
// the Floor. On an authenticated Board a forged record under the key gives
// its Forgery (wrapping ErrForged) at once: no filer writes over it (the
// next genuine notice goes to a later index), and the caller moves on to
// i+1.
func (b *Board) AwaitNotice(ctx context.Context, i int) (Notice, error) {
	if err := b.waitKept(ctx, reportKey(i), func(f Floor) bool { return f.noticeCollected(i) }); err != nil {
		return Notice{}, fmt.Errorf("shrink: await notice %d: %w", i, err)
	}
	b.seen(i)
	return b.readNotice(ctx, i)
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
