//go:build cgo && linux

package nccl

import (
	"context"
	"encoding/hex"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/gorunhq/gorun/pg"
	"github.com/gorunhq/gorun/rendezvous/tcpstore"
)

// growWorld is where a group's members and its newcomers meet: one store
// server, one client per rank (a client runs one request at a time, and a
// rank waiting in Get must not hold up another's Set).
type growWorld struct {
	t           *testing.T
	addr        string
	lib         string
	nonBlocking bool
	timeout     time.Duration // each rank's bootstrap timeout
	mark        int           // the double's log lines before the grow
}

func newGrowWorld(t *testing.T, lib string) *growWorld {
	t.Helper()
	_, addr := testStore(t, 5*time.Second)
	return &growWorld{t: t, addr: addr, lib: lib, timeout: 5 * time.Second}
}

// client dials the world's store; it is closed when the test ends.
func (w *growWorld) client() *tcpstore.Client {
	w.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	c, err := tcpstore.Dial(ctx, w.addr, tcpstore.ClientConfig{Timeout: w.timeout})
	if err != nil {
		w.t.Fatal(err)
	}
	w.t.Cleanup(func() { c.Close() })
	return c
}

// config is rank of size on the world's library, with a store client of
// its own, under namespace "job".
func (w *growWorld) config(rank, size int) Config {
	cfg := DefaultConfig()
	cfg.Bootstrap = pg.Bootstrap{Store: w.client(), Namespace: "job", Rank: rank, Size: size, Timeout: w.timeout}
	cfg.NCCLLibrary, cfg.CUDALibrary = w.lib, w.lib
	cfg.WatchdogInterval = 5 * time.Millisecond
	cfg.NonBlocking = w.nonBlocking
	return cfg
}

// members forms a group of size ranks (each New in a goroutine, as the
// id exchange needs) and marks the double's log, so that growCalls sees
// only the grow's calls. The groups are closed when the test ends.
func (w *growWorld) members(size int) []*Group {
	w.t.Helper()
	cfgs := make([]Config, size)
	for r := range cfgs {
		cfgs[r] = w.config(r, size)
	}
	groups := make([]*Group, size)
	errs := allRanks(size, func(r int) (err error) {
		groups[r], err = New(context.Background(), cfgs[r])
		return err
	})
	for r, err := range errs {
		if err != nil {
			w.t.Fatalf("member %d: New: %v", r, err)
		}
		w.t.Cleanup(func() { groups[r].Close() })
	}
	w.mark = len(calls(w.t, ""))
	return groups
}

// growCalls is calls since the members formed their group.
func (w *growWorld) growCalls(prefix string) []string {
	w.t.Helper()
	var out []string
	for _, l := range calls(w.t, "")[w.mark:] {
		if strings.HasPrefix(l, prefix) {
			out = append(out, l)
		}
	}
	return out
}

// grow runs Grow on every member and JoinGrow for newcomers newcomers (of
// the spec's Added), all at once, within timeout; it returns the groups
// and errors in rank order. The grown groups are closed when the test ends.
func (w *growWorld) grow(members []*Group, spec pg.GrowSpec, newcomers int, timeout time.Duration) ([]pg.ProcessGroup, []error) {
	w.t.Helper()
	size := len(members) + spec.Added
	cfgs := make([]Config, newcomers)
	for i := range cfgs {
		cfgs[i] = w.config(len(members)+i, size)
	}
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	out := make([]pg.ProcessGroup, len(members)+newcomers)
	errs := allRanks(len(out), func(r int) error {
		var err error
		if r < len(members) {
			out[r], err = members[r].Grow(ctx, spec)
			return err
		}
		var g *Group
		g, err = JoinGrow(ctx, cfgs[r-len(members)], spec)
		if g != nil {
			out[r] = g
		}
		return err
	})
	for _, g := range out {
		if g != nil {
			w.t.Cleanup(func() { g.Close() })
		}
	}
	return out, errs
}

// allRanks runs f for every rank in a goroutine of its own and returns
// their errors in rank order.
func allRanks(n int, f func(r int) error) []error {
	errs := make([]error, n)
	var wg sync.WaitGroup
	for r := range n {
		wg.Go(func() { errs[r] = f(r) })
	}
	wg.Wait()
	return errs
}

// grownRanks checks that every rank formed its grown group, with its rank
// and the grown size, and that it runs a barrier.
func grownRanks(t *testing.T, grown []pg.ProcessGroup, errs []error) {
	t.Helper()
	for r, err := range errs {
		if err != nil {
			t.Fatalf("rank %d: %v", r, err)
		}
	}
	for r, g := range grown {
		if g.Rank() != r || g.Size() != len(grown) {
			t.Errorf("rank %d's grown group is rank %d of %d, want %d of %d", r, g.Rank(), g.Size(), r, len(grown))
		}
		if err := g.Barrier(context.Background()); err != nil {
			t.Errorf("rank %d: Barrier on the grown group: %v", r, err)
		}
	}
}

// membersUsable checks that the members' old groups still run a barrier.
func membersUsable(t *testing.T, members []*Group) {
	t.Helper()
	for r, g := range members {
		if err := g.Barrier(context.Background()); err != nil {
			t.Errorf("member %d: Barrier on the old group: %v", r, err)
		}
	}
}

// growID returns the hex id of the grow's one log line starting with
// prefix.
func (w *growWorld) growID(prefix string) string {
	w.t.Helper()
	got := w.growCalls(prefix)
	if len(got) != 1 {
		w.t.Fatalf("log lines %q: %q, want one", prefix, got)
	}
	_, id, ok := strings.Cut(got[0], " id=")
	if !ok || len(id) != 2*uniqueIDBytes {
		w.t.Fatalf("log line %q has no %d-byte id", got[0], uniqueIDBytes)
	}
	return id
}

// checkGrow checks a grow under namespace by method after the fact: the
// calls of the method (every rank's, in any order) are want and none
// starts with a prefix in not; the store holds method and the raw bytes
// of id; the members' old groups still work.
func (w *growWorld) checkGrow(members []*Group, namespace, method, id string, want []string, not ...string) {
	w.t.Helper()
	got := w.growCalls(method)
	slices.Sort(got)
	slices.Sort(want)
	if !slices.Equal(got, want) {
		w.t.Errorf("%s calls:\n%s\nwant:\n%s", method, strings.Join(got, "\n"), strings.Join(want, "\n"))
	}
	for _, p := range not {
		if other := w.growCalls(p); len(other) != 0 {
			w.t.Errorf("a grow by %s called %s: %q", method, p, other)
		}
	}
	if v := w.storeValue(namespace + "/0"); hex.EncodeToString(v) != id {
		w.t.Errorf("store %s/0 = %x, want the 128 raw bytes of %s", namespace, v, id)
	}
	if v := string(w.storeValue(namespace + "/method")); v != method {
		w.t.Errorf("store %s/method = %q, want %q", namespace, v, method)
	}
	membersUsable(w.t, members)
}

// storeValue reads key of the world's store.
func (w *growWorld) storeValue(key string) []byte {
	w.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	v, err := w.client().Get(ctx, key)
	if err != nil {
		w.t.Fatalf("store %s: %v", key, err)
	}
	return v
}

// TestGrowInPlace: where the library has ncclCommGrow, the root member
// takes the grow's id from its communicator (ncclCommGetUniqueId) and
// publishes its raw bytes under the namespace's key "0"; every member grows
// its communicator (rank -1, NULL config, the id from the root only), every
// newcomer grows from NULL with that id and its rank, blocking even where
// its own group would be non-blocking (growsInPlace).
func TestGrowInPlace(t *testing.T) {
	for _, tt := range []struct {
		name                 string
		nonBlockingNewcomers bool
	}{
		{"blocking", false},
		{"non-blocking newcomers", true},
	} {
		t.Run(tt.name, func(t *testing.T) {
			useDouble(t, "version=22907")
			w := newGrowWorld(t, doubleLib)
			members := w.members(2)
			w.nonBlocking = tt.nonBlockingNewcomers
			spec := pg.GrowSpec{Added: 2, Namespace: "epoch7"}
			grown, errs := w.grow(members, spec, 2, 10*time.Second)
			grownRanks(t, grown, errs)

			id := w.growID("ncclCommGetUniqueId rank=0 nranks=2 ")
			want := []string{
				"ncclCommGrow parent=0/2 nranks=4 rank=-1 config=NULL newrank=0 id=" + id,
				"ncclCommGrow parent=1/2 nranks=4 rank=-1 config=NULL newrank=1 id=NULL",
				"ncclCommGrow parent=NULL nranks=4 rank=2 config=blocking=1 newrank=2 id=" + id,
				"ncclCommGrow parent=NULL nranks=4 rank=3 config=blocking=1 newrank=3 id=" + id,
			}
			w.checkGrow(members, "epoch7", "ncclCommGrow", id, want, "ncclGetUniqueId", "ncclCommInit")
		})
	}
}

// TestGrowFallback: a library without ncclCommGrow (or older than 2.29)
// grows by forming a fresh communicator of the grown size: the root member
// makes an id with ncclGetUniqueId, and members (same ranks) and newcomers
// (the next ones) init with it.
func TestGrowFallback(t *testing.T) {
	for _, tt := range []struct {
		name, lib, version, init string
		nonBlocking              bool
	}{
		{"no ncclCommGrow in 2.29", noGrowLib, "version=22907", "ncclCommInitRankConfig", false},
		{"2.28.7 has the symbol, not the version", doubleLib, "version=22807", "ncclCommInitRankConfig", false},
		{"2.13.4", oldDoubleLib, "version=21304", "ncclCommInitRank", false},
		// growsInPlace: not by a non-blocking ncclCommGrow, even in 2.29.
		{"a non-blocking group in 2.29", doubleLib, "version=22907\ninit_polls=2", "ncclCommInitRankConfig", true},
	} {
		t.Run(tt.name, func(t *testing.T) {
			useDouble(t, tt.version)
			w := newGrowWorld(t, tt.lib)
			w.nonBlocking = tt.nonBlocking
			members := w.members(2)
			spec := pg.GrowSpec{Added: 1, Namespace: "heal/1"}
			grown, errs := w.grow(members, spec, 1, 10*time.Second)
			grownRanks(t, grown, errs)

			id := w.growID("ncclGetUniqueId ")
			var want []string
			for r := range 3 {
				want = append(want, fmt.Sprintf("%s nranks=3 rank=%d blocking=%d id=%s", tt.init, r, map[bool]int{false: 1, true: 0}[tt.nonBlocking], id))
			}
			w.checkGrow(members, "heal/1", "ncclCommInitRank", id, want, "ncclCommGrow", "ncclCommGetUniqueId")
		})
	}
}

// TestGrowNewcomerNeverComes: the members give up within their context,
// before any NCCL call (the root took no grow id), keep their group, and
// can grow later.
func TestGrowNewcomerNeverComes(t *testing.T) {
	useDouble(t, "version=22907")
	w := newGrowWorld(t, doubleLib)
	members := w.members(2)
	start := time.Now()
	_, errs := w.grow(members, pg.GrowSpec{Added: 1, Namespace: "epoch3"}, 0, 200*time.Millisecond)
	if d := time.Since(start); d > 3*time.Second {
		t.Errorf("the grow gave up after %v", d)
	}
	for r, err := range errs {
		if !errors.Is(err, pg.ErrTimeout) {
			t.Errorf("member %d: %v, want an error wrapping pg.ErrTimeout", r, err)
		}
	}
	if !strings.Contains(errs[0].Error(), "waiting for newcomers 2 to 2") {
		t.Errorf("root: %v, want it to say it waited for newcomer 2", errs[0])
	}
	if got := append(w.growCalls("ncclCommGetUniqueId"), w.growCalls("ncclCommGrow")...); len(got) != 0 {
		t.Errorf("a grow without its newcomer reached NCCL: %q", got)
	}
	membersUsable(t, members)

	// The double, like NCCL, refuses a second grow id while one is
	// unconsumed: this grow works only because the first took none.
	grown, errs := w.grow(members, pg.GrowSpec{Added: 1, Namespace: "epoch4"}, 1, 10*time.Second)
	grownRanks(t, grown, errs)
}

// stuckGrow starts a Grow by one newcomer on member under namespace ns,
// within mctx, while the newcomer's own side, which never completes
// either, gives up after 200 ms; it returns once the member has made the
// NCCL call that starts with call, with the Grow's result channel.
func (w *growWorld) stuckGrow(mctx context.Context, member *Group, ns, call string) <-chan error {
	w.t.Helper()
	res := make(chan error, 1)
	go func() {
		_, err := member.Grow(mctx, pg.GrowSpec{Added: 1, Namespace: ns})
		res <- err
	}()
	short, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancel()
	if _, err := JoinGrow(short, w.config(1, 2), pg.GrowSpec{Added: 1, Namespace: ns}); !errors.Is(err, pg.ErrTimeout) {
		w.t.Errorf("newcomer: %v, want an error wrapping pg.ErrTimeout", err)
	}
	for len(w.growCalls(call)) == 0 {
		select {
		case err := <-res:
			w.t.Fatalf("Grow returned before the member called %s: %v", call, err)
		case <-time.After(time.Millisecond):
		}
	}
	return res
}

// TestGrowAbortedMeanwhile: Abort ends a member's wait for a non-blocking
// grow (a fresh communicator: growsInPlace) at once; the half-grown
// communicator is aborted.
func TestGrowAbortedMeanwhile(t *testing.T) {
	useDouble(t, "version=22907")
	w := newGrowWorld(t, doubleLib)
	w.nonBlocking = true
	members := w.members(1)
	setControl(t, "version=22907", "init_polls=-1") // the grown communicators never get ready
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	res := w.stuckGrow(ctx, members[0], "epoch2", "ncclCommInitRankConfig nranks=2 rank=0 ")
	members[0].Abort(errors.New("peer lost meanwhile"))
	if err := within(t, res, time.Second); !errors.Is(err, pg.ErrAborted) {
		t.Errorf("member: %v, want an error wrapping pg.ErrAborted", err)
	}
	if got := w.growCalls("ncclCommAbort rank="); !slices.Contains(got, "ncclCommAbort rank=0 nranks=2") || !slices.Contains(got, "ncclCommAbort rank=1 nranks=2") {
		t.Errorf("abort calls %q, want both half-grown communicators aborted", got)
	}
}

// TestGrowBlockingGivenUp: a blocking ncclCommGrow that never returns (a
// newcomer announced itself, then never joined) holds no one up. Abort
// returns at once and so does the member's Grow; so does a Grow whose
// context ends. The group is then stopped, its communicator left to the
// call, and both what the call makes and that communicator are aborted
// when it returns; the member re-forms afresh meanwhile.
func TestGrowBlockingGivenUp(t *testing.T) {
	for _, tt := range []struct {
		name  string
		abort bool // Abort the member; else its Grow's context ends
		want  error
	}{
		{"aborted", true, pg.ErrAborted},
		{"deadline", false, pg.ErrTimeout},
	} {
		t.Run(tt.name, func(t *testing.T) {
			useDouble(t, "version=22907")
			w := newGrowWorld(t, doubleLib)
			members := w.members(1)
			setControl(t, "version=22907", "grow_block=1")
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			mctx := ctx
			if !tt.abort {
				var mcancel context.CancelFunc
				mctx, mcancel = context.WithTimeout(ctx, 300*time.Millisecond)
				defer mcancel()
			}
			res := w.stuckGrow(mctx, members[0], "epoch3", "ncclCommGrow parent=0/1")
			if tt.abort {
				aborted := make(chan struct{})
				go func() { members[0].Abort(errors.New("the newcomer's node lost")); close(aborted) }()
				select {
				case <-aborted:
				case <-time.After(time.Second):
					t.Fatal("Abort waited for the blocking ncclCommGrow")
				}
			}
			if err := within(t, res, 2*time.Second); !errors.Is(err, tt.want) {
				t.Errorf("member's Grow: %v, want an error wrapping %v", err, tt.want)
			}
			if err := members[0].Barrier(ctx); !errors.Is(err, pg.ErrAborted) {
				t.Errorf("Barrier on the group whose communicator was left to NCCL: %v, want pg.ErrAborted", err)
			}
			if got := w.growCalls("ncclCommAbort"); len(got) != 0 {
				t.Errorf("communicators aborted while the call still had them: %q", got)
			}
			// The member re-forms with a fresh communicator meanwhile.
			again, err := members[0].Grow(ctx, pg.GrowSpec{Added: 0, Namespace: "epoch4"})
			if err != nil {
				t.Fatalf("re-forming after the grow was given up: %v", err)
			}
			defer again.Close()
			if err := again.Barrier(ctx); err != nil {
				t.Errorf("Barrier on the re-formed group: %v", err)
			}
			// The calls return: what they made, and the lent communicator,
			// are aborted then.
			setControl(t, "version=22907")
			want := []string{"ncclCommAbort rank=0 nranks=1", "ncclCommAbort rank=0 nranks=2", "ncclCommAbort rank=1 nranks=2"}
			for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(5 * time.Millisecond) {
				got := w.growCalls("ncclCommAbort")
				slices.Sort(got)
				if slices.Equal(got, want) {
					break
				}
				if time.Now().After(deadline) {
					t.Fatalf("abort calls after the blocking calls returned: %q, want %q", got, want)
				}
			}
		})
	}
}

// TestJoinGrowMembersNeverCome: a newcomer whose members never publish an
// id gives up within its bootstrap timeout and gives its device back.
func TestJoinGrowMembersNeverCome(t *testing.T) {
	useDouble(t)
	w := newGrowWorld(t, doubleLib)
	w.timeout = 100 * time.Millisecond
	start := time.Now()
	g, err := JoinGrow(context.Background(), w.config(2, 3), pg.GrowSpec{Added: 1, Namespace: "epoch9"})
	if err == nil {
		g.Close()
		t.Fatal("JoinGrow formed a group without members")
	}
	if !errors.Is(err, pg.ErrTimeout) || !strings.Contains(err.Error(), "[2] waiting for the grow's id from [0]") {
		t.Errorf("JoinGrow: %v, want a timeout waiting for the id", err)
	}
	if d := time.Since(start); d > 3*time.Second {
		t.Errorf("JoinGrow gave up after %v", d)
	}
	// useDouble's cleanup checks that the device and its memory came back.
}

// TestGrowLibraryError: a failed ncclCommGrow is an *Error naming it; the
// members keep their group.
func TestGrowLibraryError(t *testing.T) {
	useDouble(t, "version=22907")
	w := newGrowWorld(t, doubleLib)
	members := w.members(2)
	setControl(t, "version=22907", "grow_error=2")
	_, errs := w.grow(members, pg.GrowSpec{Added: 1, Namespace: "epoch5"}, 1, 10*time.Second)
	for r, err := range errs {
		var ne *Error
		if !errors.As(err, &ne) || ne.Op != "ncclCommGrow" || ne.Result != SystemError {
			t.Errorf("rank %d: %v, want ncclSystemError from ncclCommGrow", r, err)
		}
	}
	setControl(t, "version=22907")
	if got := w.growCalls("ncclCommGetUniqueId"); len(got) != 1 {
		t.Errorf("id calls %q, want the root's one", got)
	}
	membersUsable(t, members)
}

// TestJoinGrowWithoutGrowEntryPoint: the members grow in place, and a
// newcomer whose library cannot says so instead of taking another path.
func TestJoinGrowWithoutGrowEntryPoint(t *testing.T) {
	useDouble(t, "version=22907")
	w := newGrowWorld(t, doubleLib)
	members := w.members(1)
	cfg := w.config(1, 2)
	cfg.NCCLLibrary, cfg.CUDALibrary = noGrowLib, noGrowLib
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	var child pg.ProcessGroup
	errs := allRanks(2, func(r int) (err error) {
		if r == 0 {
			// The double's grow does not wait for the newcomer.
			child, err = members[0].Grow(ctx, pg.GrowSpec{Added: 1, Namespace: "mixed"})
			return err
		}
		g, err := JoinGrow(ctx, cfg, pg.GrowSpec{Added: 1, Namespace: "mixed"})
		if err == nil {
			g.Close()
		}
		return err
	})
	if errs[0] != nil {
		t.Fatalf("member: %v", errs[0])
	}
	child.Close()
	if !errors.Is(errs[1], pg.ErrNotSupported) || !strings.Contains(errs[1].Error(), "the members grow with ncclCommGrow") {
		t.Errorf("newcomer: %v, want ErrNotSupported", errs[1])
	}
}

// TestGrowRefused: invalid specs, a rank that is not a newcomer's, an
// aborted and a closed group are refused before NCCL is called.
func TestGrowRefused(t *testing.T) {
	useDouble(t)
	w := newGrowWorld(t, doubleLib)
	g := w.members(1)[0]
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	for _, tt := range []struct {
		spec pg.GrowSpec
		want string
	}{
		{pg.GrowSpec{Added: -1, Namespace: "x"}, "-1 newcomers"},
		{pg.GrowSpec{Added: 1}, "no namespace"},
	} {
		if _, err := g.Grow(ctx, tt.spec); !errors.Is(err, pg.ErrInvalidArgument) || !strings.Contains(err.Error(), tt.want) {
			t.Errorf("Grow(%+v): %v, want ErrInvalidArgument saying %q", tt.spec, err, tt.want)
		}
		if _, err := JoinGrow(ctx, w.config(1, 2), tt.spec); !errors.Is(err, pg.ErrInvalidArgument) {
			t.Errorf("JoinGrow(%+v): %v, want ErrInvalidArgument", tt.spec, err)
		}
	}
	for _, tt := range []struct{ rank, size, added int }{
		{0, 2, 1}, // a member's rank
		{2, 2, 1}, // out of range
		{1, 2, 2}, // no members left
	} {
		cfg := w.config(0, tt.size)
		cfg.Bootstrap.Rank = tt.rank
		_, err := JoinGrow(ctx, cfg, pg.GrowSpec{Added: tt.added, Namespace: "x"})
		if !errors.Is(err, pg.ErrInvalidArgument) {
			t.Errorf("JoinGrow as rank %d of %d with %d added: %v, want ErrInvalidArgument", tt.rank, tt.size, tt.added, err)
		}
	}
	if got := append(w.growCalls("ncclComm"), w.growCalls("ncclGetUniqueId")...); len(got) != 0 {
		t.Errorf("refused grows reached NCCL: %q", got)
	}
	if err := g.Barrier(ctx); err != nil {
		t.Errorf("Barrier after refused grows: %v", err)
	}

	g.Close()
	if _, err := g.Grow(ctx, pg.GrowSpec{Added: 1, Namespace: "x"}); !errors.Is(err, pg.ErrClosed) {
		t.Errorf("Grow of a closed group: %v, want ErrClosed", err)
	}
}

// TestGrowAfterAbort: members whose group was aborted (shrink's Follower
// aborts it the moment a grow epoch comes, so that every member stops where
// it is) grow through a fresh communicator, even where NCCL grows in place:
// a stopped communicator cannot. A grow of no newcomers re-forms them the
// same way.
func TestGrowAfterAbort(t *testing.T) {
	for _, added := range []int{1, 0} {
		t.Run(fmt.Sprintf("%d added", added), func(t *testing.T) {
			useDouble(t, "version=22907")
			w := newGrowWorld(t, doubleLib)
			members := w.members(2)
			for _, g := range members {
				g.Abort(errors.New("a grow epoch came"))
			}
			spec := pg.GrowSpec{Added: added, Namespace: "epoch4"}
			grown, errs := w.grow(members, spec, added, 10*time.Second)
			grownRanks(t, grown, errs)
			id := w.growID("ncclGetUniqueId ")
			var want []string
			for r := range 2 + added {
				want = append(want, fmt.Sprintf("ncclCommInitRankConfig nranks=%d rank=%d blocking=1 id=%s", 2+added, r, id))
			}
			got := w.growCalls("ncclCommInitRank")
			slices.Sort(got)
			if !slices.Equal(got, want) {
				t.Errorf("init calls:\n%s\nwant:\n%s", strings.Join(got, "\n"), strings.Join(want, "\n"))
			}
			if other := append(w.growCalls("ncclCommGrow"), w.growCalls("ncclCommGetUniqueId")...); len(other) != 0 {
				t.Errorf("a stopped group grew in place: %q", other)
			}
		})
	}
}

// TestProbeGrow: Probe's grow=yes needs both entry points and NCCL 2.29.
func TestProbeGrow(t *testing.T) {
	for _, tt := range []struct {
		lib, version string
		grow         bool
		found        string
	}{
		{doubleLib, "version=22907", true, "symbols=21/21"},
		{doubleLib, "version=22807", false, "symbols=21/21"},
		{noGrowLib, "version=22907", false, "symbols=19/21"},
	} {
		useDouble(t, tt.version)
		rep, err := Probe(tt.lib)
		if err != nil {
			t.Fatalf("Probe(%s): %v", tt.lib, err)
		}
		if rep.Grow != tt.grow || !strings.Contains(rep.String(), tt.found) {
			t.Errorf("Probe(%s) with %s: %q, want grow=%v and %s", tt.lib, tt.version, rep, tt.grow, tt.found)
		}
	}
}
