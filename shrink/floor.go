package shrink

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"strconv"
	"strings"

	"github.com/gorunhq/gorun/rendezvous"
)

// ErrCollected: the record a reader waits for was collected (deleted below
// the Board's Floor) before it read it: the reader fell a whole heal cycle
// behind. It starts again from the Floor.
var ErrCollected = errors.New("collected below the board's floor")

// floorKey is the Floor's key under the Board's prefix.
const floorKey = "floor"

// Floor is where the Board's history starts: what a reader that comes late
// (an agent admitted into a running round, a Coordinator started anew)
// starts from instead of epoch 1 and notice 1, and how far the collection
// of old records has gone. Without it the Board would keep every epoch,
// acknowledgement counter and notice for ever: about seven keys a heal
// cycle, and a job that heals all week fills its store.
//
// The leader raises it when a grow completes and its Decider has nothing
// pending (Decider.Floor): the grown epoch then says all there is to know,
// and no notice filed until then matters to a Decider that starts from it.
// Raising it collects the records below the floor before (a generation
// behind, so a reader that lags by up to a heal cycle still finds what it
// waits for): epochs and their acks below that floor's epoch, notices
// up to its notice, and the group-formation keys of those epochs (Go's
// under Namespace, gorun_ft.py's under gorun_ft/attempt_<k>/epoch_<n>/)
// where the store can list its keys.
type Floor struct {
	// Epoch is the epoch to start from; 0 (no floor yet) is the launch.
	Epoch int `json:"epoch"`
	// Notice is the last notice a reader that starts from Epoch may skip:
	// Epoch settled every one up to it.
	Notice int `json:"notice"`
	// LostIn names, for each slot lost in Epoch, the epoch that excluded
	// it: what was lost together is grown back together
	// (Config.RejoinWait), and a Decider that starts from Epoch has not
	// seen those epochs.
	LostIn map[int]int `json:"lost_in,omitempty"`
	// SweptEpoch and SweptNotice say what is collected: every epoch below
	// SweptEpoch and every notice up to SweptNotice (the floor before this
	// one).
	SweptEpoch  int `json:"swept_epoch"`
	SweptNotice int `json:"swept_notice"`
	// Tickets is how many of the job's respawn tickets were taken when the
	// floor was raised: tickets 1 to Tickets are spent, and a taker starts
	// after them (TakeRespawn), so that they can be collected a generation
	// later like the epochs; SweptTickets, every ticket up to it is gone.
	// Without it a job that heals all week keeps a key per respawn.
	Tickets      int `json:"tickets,omitempty"`
	SweptTickets int `json:"swept_tickets,omitempty"`
}

// collected reports whether epoch n's records are gone.
func (f Floor) collected(n int) bool { return n < f.SweptEpoch }

// noticeCollected reports whether notice i is gone.
func (f Floor) noticeCollected(i int) bool { return i <= f.SweptNotice }

// Floor returns the Board's Floor: the zero Floor while none was raised. On
// an authenticated Board a forged floor is refused (reported by the Auth)
// and counts as none: readers then start from epoch 1, as before any
// collection. (Whoever can write the store can delete its keys too, which
// no MAC prevents; binding the store where it is used does.)
func (b *Board) Floor(ctx context.Context) (Floor, error) {
	f, _, err := b.readFloor(ctx)
	return f, err
}

// readFloor returns the Floor and the bytes it was read from (nil when the
// key is absent).
func (b *Board) readFloor(ctx context.Context) (Floor, []byte, error) {
	ok, err := b.store.Check(ctx, floorKey)
	if err != nil || !ok {
		return Floor{}, nil, wrapFloor(err)
	}
	raw, err := b.store.Get(ctx, floorKey)
	if err != nil {
		return Floor{}, nil, wrapFloor(err)
	}
	rec, err := b.open(floorKey, raw)
	if errors.Is(err, ErrForged) {
		return Floor{}, raw, nil
	}
	if err != nil {
		return Floor{}, raw, err
	}
	var f Floor
	if err := json.Unmarshal(rec, &f); err != nil {
		return Floor{}, raw, fmt.Errorf("shrink: the board's floor: %w", err)
	}
	return f, raw, nil
}

func wrapFloor(err error) error {
	if err == nil {
		return nil
	}
	return fmt.Errorf("shrink: read the board's floor: %w", err)
}

// Raise makes next the Board's Floor, unless the floor is there already or
// higher (another leader raised it), and collects what falls a generation
// behind: the records below the floor it replaces. It fills in next's
// Swept fields. A failure midway leaves some records uncollected, once;
// the floor itself is written first, so no reader is sent to a record
// that is gone.
func (b *Board) Raise(ctx context.Context, next Floor) error {
	for {
		cur, raw, err := b.readFloor(ctx)
		if err != nil {
			return err
		}
		if cur.Epoch >= next.Epoch {
			return nil
		}
		next.SweptEpoch, next.SweptNotice, next.SweptTickets = cur.Epoch, cur.Notice, cur.Tickets
		if next.Tickets, err = b.countTickets(ctx, max(cur.Tickets, int(b.tickets.Load()))); err != nil {
			return err
		}
		rec, err := json.Marshal(next)
		if err == nil {
			rec, err = b.seal(floorKey, rec)
		}
		if err != nil {
			return fmt.Errorf("shrink: encode the floor: %w", err)
		}
		got, err := b.store.CompareSet(ctx, floorKey, raw, rec)
		if err != nil {
			return fmt.Errorf("shrink: raise the floor to epoch %d: %w", next.Epoch, err)
		}
		if !bytes.Equal(got, rec) {
			continue // raced: look again
		}
		return b.sweep(ctx, cur)
	}
}

// countTickets returns how many respawn tickets are taken, knowing that
// the first from are: it looks on from there for the first ticket that is
// absent or forged (a forged one is taken over by the next taker, so it
// spends nothing and must stay). The look is a check a ticket taken since
// the last floor, and one more.
func (b *Board) countTickets(ctx context.Context, from int) (int, error) {
	for k := from + 1; ; k++ {
		key := ticketKey(k)
		ok, err := b.store.Check(ctx, key)
		if err != nil {
			return 0, fmt.Errorf("shrink: count the respawn tickets: %w", err)
		}
		if !ok {
			return k - 1, nil
		}
		raw, err := b.store.Get(ctx, key)
		if err != nil {
			return 0, fmt.Errorf("shrink: count the respawn tickets: %w", err)
		}
		if _, err := b.open(key, raw); err != nil {
			return k - 1, nil // forged: the next taker takes it over
		}
	}
}

// sweep deletes the records below floor f that the floor before it still
// kept: epochs (with their counters and formation keys) from f.SweptEpoch
// up to f.Epoch, notices after f.SweptNotice up to f.Notice, and respawn
// tickets after f.SweptTickets up to f.Tickets.
func (b *Board) sweep(ctx context.Context, f Floor) error {
	var gone []string
	for n := max(f.SweptEpoch, 1); n < f.Epoch; n++ {
		// Its members' acks first: the epoch says who they are.
		e, ok, err := b.Lookup(ctx, n)
		if err != nil {
			return fmt.Errorf("shrink: read epoch %d below the floor: %w", n, err)
		}
		for g, r := range e.Ranks {
			if ok && r >= 0 {
				gone = append(gone, memberAckKey(n, g))
			}
		}
		gone = append(gone, epochKey(n), ackKey(n))
	}
	for i := f.SweptNotice + 1; i <= f.Notice; i++ {
		gone = append(gone, reportKey(i))
	}
	for k := f.SweptTickets + 1; k <= f.Tickets; k++ {
		gone = append(gone, ticketKey(k))
	}
	for _, k := range gone {
		if _, err := b.store.Delete(ctx, k); err != nil {
			return fmt.Errorf("shrink: collect %s below the floor: %w", k, err)
		}
	}
	if b.raw == nil || f.Epoch <= max(f.SweptEpoch, 1) {
		return nil
	}
	// The groups of those epochs formed under Namespace(n): their keys
	// (gloo's, pg/cpu's, gorun_ft's) are done with too. Only a store
	// that can list its keys (gorun's) gives them up.
	keys, err := b.raw.ListKeys(ctx)
	if errors.Is(err, rendezvous.ErrNotSupported) {
		return nil // PyTorch's server cannot list: those keys stay
	}
	if err != nil {
		return fmt.Errorf("shrink: list the formation keys below the floor: %w", err)
	}
	for _, k := range keys {
		if n, ok := formedIn(k); ok && n >= max(f.SweptEpoch, 1) && n < f.Epoch {
			if _, err := b.raw.Delete(ctx, k); err != nil {
				return fmt.Errorf("shrink: collect %s below the floor: %w", k, err)
			}
		}
	}
	return nil
}

// formedIn returns the epoch whose group formation wrote key: a key under
// Namespace(n) ("gorun/epoch/<n>/…", Go's pg backends), or under
// gorun_ft.py's "gorun_ft/attempt_<k>/epoch_<n>/…" (PyTorch's groups, n ≥ 1).
func formedIn(key string) (int, bool) {
	if rest, ok := strings.CutPrefix(key, "gorun/epoch/"); ok {
		n, _, ok := strings.Cut(rest, "/")
		return epochNumber(n, ok)
	}
	rest, ok := strings.CutPrefix(key, "gorun_ft/attempt_")
	if !ok {
		return 0, false
	}
	_, rest, ok = strings.Cut(rest, "/")
	if rest, ok = strings.CutPrefix(rest, "epoch_"); !ok {
		return 0, false
	}
	n, _, ok := strings.Cut(rest, "/")
	return epochNumber(n, ok)
}

// epochNumber parses the decimal epoch number n, ok only when the key went
// on past it.
func epochNumber(n string, ok bool) (int, bool) {
	v, err := strconv.Atoi(n)
	if !ok || err != nil || v < 1 {
		return 0, false
	}
	return v, true
}

// Floor returns the Floor the leader may raise once the current epoch is
// complete, whose notices up to notice (the last this Decider applied)
// were all applied: ok only when nothing is pending (no failure reported,
// no join offered, no news of a later epoch), so that a Decider started
// from the current epoch, reading notices after notice, decides as this one
// does.
func (d *Decider) Floor(notice int) (Floor, bool) {
	if !d.complete || len(d.pending) > 0 || len(d.joins) > 0 || len(d.early) > 0 || d.current.Number < 1 {
		return Floor{}, false
	}
	return Floor{Epoch: d.current.Number, Notice: notice, LostIn: maps.Clone(d.lostIn)}, true
}

// ResumeDecider returns a decider for the coordinator called name that
// starts from floor f's epoch e, as one that had followed the Board from
// the launch would be at f's notice.
func ResumeDecider(name string, cfg Config, e Epoch, f Floor) *Decider {
	d := NewDecider(name, cfg, e)
	d.complete = true // a floor's epoch is complete: Decider.Floor says so
	clear(d.awaiting)
	for g, n := range f.LostIn {
		if !e.Alive(g) {
			d.lostIn[g] = n
		}
	}
	return d
}
