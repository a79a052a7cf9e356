package shrink

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/gorunhq/gorun/rendezvous"
)

// testAuth returns an Auth under a test secret for scope, and the
// forgeries it reported, in order.
func testAuth(t *testing.T, scope string) (*Auth, func() []Forgery) {
	t.Helper()
	var mu sync.Mutex
	var got []Forgery
	a, err := NewAuth([]byte("job secret"), scope, func(f Forgery) {
		mu.Lock()
		defer mu.Unlock()
		got = append(got, f)
	})
	if err != nil {
		t.Fatal(err)
	}
	return a, func() []Forgery {
		mu.Lock()
		defer mu.Unlock()
		return slices.Clone(got)
	}
}

// flip returns b with the byte at i changed (i < 0 counts from the end).
func flip(b []byte, i int) []byte {
	b = bytes.Clone(b)
	if i < 0 {
		i += len(b)
	}
	b[i] ^= 1
	if b[i] == '"' || b[i] == '}' || b[i] == '{' {
		b[i] ^= 3
	}
	return b
}

// The fixed vector below pins the MAC's construction; gorun_ft.py is held
// to the same bytes by TestAuthPython.
const (
	vectorSecret = "job secret"
	vectorScope  = "job-7/2"
	vectorKey    = "epoch/3"
	vectorBody   = `{"epoch":3,"action":"shrink"}`
	vectorSealed = `{"epoch":3,"action":"shrink","mac":"16ca2954044e7e0bef1573ea60d1f0c5e9777340d14fe28f2be0b6f48cfa74df"}`
)

func TestAuthSealOpen(t *testing.T) {
	a, forged := testAuth(t, vectorScope)
	sealed, err := a.seal(vectorKey, []byte(vectorBody))
	if err != nil {
		t.Fatal(err)
	}
	if string(sealed) != vectorSealed {
		t.Fatalf("sealed\n%s\nwant\n%s", sealed, vectorSealed)
	}
	var parsed struct {
		Epoch int    `json:"epoch"`
		MAC   string `json:"mac"`
	}
	if err := json.Unmarshal(sealed, &parsed); err != nil || parsed.Epoch != 3 || len(parsed.MAC) != 64 {
		t.Fatalf("a sealed record is not the JSON readers parse: %+v %v", parsed, err)
	}
	if body, err := a.open(vectorKey, sealed); err != nil || string(body) != vectorBody {
		t.Fatalf("open = %q %v, want the body back", body, err)
	}
	other, _ := testAuth(t, "job-7/1")
	otherSecret, err := NewAuth([]byte("another secret"), vectorScope, nil)
	if err != nil {
		t.Fatal(err)
	}
	upper := bytes.Replace(sealed, []byte("16ca"), []byte("16CA"), 1)
	tests := []struct {
		name string
		auth *Auth
		key  string
		rec  []byte
		want ForgeryReason
	}{
		{"a body byte flipped", a, vectorKey, flip(sealed, 3), BadMAC},
		{"the last body byte flipped", a, vectorKey, flip(sealed, len(vectorBody)-2), BadMAC},
		{"a MAC digit changed", a, vectorKey, bytes.Replace(sealed, []byte("16ca"), []byte("16cb"), 1), BadMAC},
		{"under another key (a replay)", a, "epoch/4", sealed, BadMAC},
		{"in another round (a replay)", other, vectorKey, sealed, BadMAC},
		{"under another secret", otherSecret, vectorKey, sealed, BadMAC},
		{"no mac", a, vectorKey, []byte(vectorBody), NoMAC},
		{"empty", a, vectorKey, nil, NoMAC},
		{"uppercase hex", a, vectorKey, upper, Malformed},
		{"a digit short", a, vectorKey, slices.Delete(bytes.Clone(sealed), len(sealed)-3, len(sealed)-2), Malformed},
		{"mac not last", a, vectorKey, []byte(`{"mac":"` + strings.Repeat("0", 64) + `","epoch":3,"action":"shrink"}`), Malformed},
		{"space before the brace", a, vectorKey, append(sealed[:len(sealed)-1:len(sealed)-1], ' ', '}'), Malformed},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := tt.auth.open(tt.key, tt.rec)
			var f Forgery
			if !errors.Is(err, ErrForged) || !errors.As(err, &f) || f.Reason != tt.want || f.Key != tt.key {
				t.Fatalf("open = %v, want a Forgery at %s: %s", err, tt.key, tt.want)
			}
		})
	}
	// Each distinct forgery once, however often it is read.
	n := len(forged())
	for range 3 {
		a.open(vectorKey, []byte(vectorBody))
	}
	if got := forged(); len(got) != n || a.Forgeries() != int64(n) {
		t.Errorf("%d forgeries reported, %d counted, after reading a known one again; want %d", len(got), a.Forgeries(), n)
	}
	if _, err := NewAuth(nil, vectorScope, nil); err == nil {
		t.Error("NewAuth with no secret succeeded")
	}
}

func TestAuthFromEnv(t *testing.T) {
	env := func(m map[string]string) func(string) string { return func(k string) string { return m[k] } }
	if a, err := AuthFromEnv(env(nil), nil); a != nil || err != nil {
		t.Errorf("AuthFromEnv without a secret = %v %v, want nil nil", a, err)
	}
	a, err := AuthFromEnv(env(map[string]string{SecretEnv: vectorSecret, "TORCHELASTIC_RUN_ID": "job-7", "GORUN_GENERATION": "2"}), nil)
	if err != nil {
		t.Fatal(err)
	}
	if got, err := a.seal(vectorKey, []byte(vectorBody)); err != nil || string(got) != vectorSealed {
		t.Errorf("the environment's Auth seals %s %v, want %s", got, err, vectorSealed)
	}
}

// gorunFT returns a command that runs script after importing gorun_ft.py
// as the module gorun_ft, with torch stubbed: the parts checked this way
// (MACs, the board's filing) need only the standard library.
func gorunFT(ctx context.Context, t *testing.T, script string) *exec.Cmd {
	t.Helper()
	py := "/usr/bin/python3"
	if _, err := os.Stat(py); err != nil {
		if py, err = exec.LookPath("python3"); err != nil {
			t.Skip("no python3")
		}
	}
	helper, err := filepath.Abs(filepath.Join("..", "examples", "torch"))
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.CommandContext(ctx, py, "-c", `
import sys, types
torch = types.ModuleType("torch"); torch.__version__ = "0.0"
torch.distributed = types.ModuleType("torch.distributed")
sys.modules["torch"], sys.modules["torch.distributed"] = torch, torch.distributed
sys.path.insert(0, sys.argv[1])
import gorun_ft
`+script, helper)
	cmd.Env = append(os.Environ(), "PYTHONDONTWRITEBYTECODE=1")
	return cmd
}

// TestAuthPython holds gorun_ft.py to the Go side's bytes: it seals what Go
// seals, opens what Go sealed and refuses the same forgeries for the same
// reasons. torch is stubbed: the MAC helpers need only the standard library.
func TestAuthPython(t *testing.T) {
	type check struct {
		Secret string `json:"secret"`
		Scope  string `json:"scope"`
		Key    string `json:"key"`
		Body   string `json:"body"`
		Rec    string `json:"rec"` // to open
		// What Go says.
		Sealed string `json:"sealed"`
		Reason string `json:"reason"` // "" when rec opens to body
	}
	var checks []check
	add := func(secret, scope, key, body string, rec []byte) {
		a, err := NewAuth([]byte(secret), scope, nil)
		if err != nil {
			t.Fatal(err)
		}
		sealed, err := a.seal(key, []byte(body))
		if err != nil {
			t.Fatal(err)
		}
		if rec == nil {
			rec = sealed
		}
		c := check{Secret: secret, Scope: scope, Key: key, Body: body, Rec: string(rec), Sealed: string(sealed)}
		if _, err := a.open(key, rec); err != nil {
			c.Reason = string(err.(Forgery).Reason)
		}
		checks = append(checks, c)
	}
	e, err := json.Marshal(mustNext(t, Initial(4), 2))
	if err != nil {
		t.Fatal(err)
	}
	join := `{"join": {"slots": [2], "from": "slot 2", "seen_at": "2026-11-26T10:00:00.000000Z"}}` // as json.dumps writes it
	add(vectorSecret, vectorScope, vectorKey, vectorBody, nil)
	add("s3cr3t\u00e9", "run/0", "epoch/1", string(e), nil)
	add("s3cr3t", "run/0", "report/12", join, nil)
	add("s3cr3t", "run/0", "report/12", join, []byte(join))
	sealed := []byte(checks[1].Sealed)
	add("s3cr3t\u00e9", "run/0", "epoch/1", string(e), flip(sealed, 10))
	add("s3cr3t\u00e9", "run/0", "epoch/1", string(e), flip(sealed, -5))
	add("s3cr3t\u00e9", "run/0", "epoch/1", string(e), bytes.ToUpper(sealed))
	add("s3cr3t\u00e9", "run/1", "epoch/1", string(e), sealed)
	in, err := json.Marshal(checks)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	cmd := gorunFT(ctx, t, `
import json
out = []
for c in json.loads(sys.stdin.read()):
    b = lambda s: s.encode("utf-8")
    sealed = gorun_ft.seal_record(b(c["secret"]), b(c["scope"]), b(c["key"]), b(c["body"])).decode()
    try:
        body = gorun_ft.open_record(b(c["secret"]), b(c["scope"]), b(c["key"]), b(c["rec"]))
        reason = "" if body == b(c["body"]) else "opened to " + body.decode()
    except gorun_ft.Forged as f:
        reason = f.reason
    out.append({"sealed": sealed, "reason": reason})
# The worker's own: from its environment, each forgery logged once.
logs = []
auth = gorun_ft.BoardAuth.from_env(logs.append)
env = auth.seal("epoch/3", b'{"epoch":3,"action":"shrink"}').decode()
for _ in range(3):
    try:
        auth.open("epoch/3", b'{"epoch":3,"action":"shrink"}')
    except gorun_ft.Forged:
        pass
print(json.dumps(out))
print(json.dumps({"sealed": env, "logs": logs}))
`)
	cmd.Stdin = bytes.NewReader(in)
	cmd.Env = append(cmd.Env,
		SecretEnv+"="+vectorSecret, "TORCHELASTIC_RUN_ID=job-7", "GORUN_GENERATION=2")
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("python: %v\n%s", err, stderr.String())
	}
	lines := strings.Split(strings.TrimSpace(string(out)), "\n")
	if len(lines) != 2 {
		t.Fatalf("python said %s, want two lines", out)
	}
	var got []struct{ Sealed, Reason string }
	if err := json.Unmarshal([]byte(lines[0]), &got); err != nil || len(got) != len(checks) {
		t.Fatalf("python said %s (%v), want %d answers", out, err, len(checks))
	}
	var fromEnv struct {
		Sealed string
		Logs   []string
	}
	if err := json.Unmarshal([]byte(lines[1]), &fromEnv); err != nil {
		t.Fatalf("python said %s: %v", out, err)
	}
	if fromEnv.Sealed != vectorSealed {
		t.Errorf("gorun_ft.BoardAuth from the environment seals %s, want %s", fromEnv.Sealed, vectorSealed)
	}
	if want := []string{"ignored a forged record at epoch/3: no MAC"}; !slices.Equal(fromEnv.Logs, want) {
		t.Errorf("gorun_ft.BoardAuth logged %q reading a forgery three times, want %q", fromEnv.Logs, want)
	}
	for i, c := range checks {
		if got[i].Sealed != c.Sealed || got[i].Reason != c.Reason {
			t.Errorf("check %d (%s, %s): python sealed %s and opened %q to %q; Go sealed %s and says %q",
				i, c.Scope, c.Key, got[i].Sealed, c.Rec, got[i].Reason, c.Sealed, c.Reason)
		}
	}
}

// authBoard returns a Board authenticated by a on a fresh connection of
// the store open reaches, and the raw store under the Board's prefix:
// where a forger writes.
func authBoard(t *testing.T, open func() rendezvous.Store, prefix string, a *Auth) (*Board, rendezvous.Store) {
	t.Helper()
	s := open()
	return NewBoard(s, prefix).Authenticated(a), rendezvous.NewPrefixStore(prefix, s)
}

// forge writes rec at key, as a forger does, and reads it back: the old
// wire does not answer a set, and the test's next step, on another
// connection, must find the record there.
func forge(ctx context.Context, t *testing.T, raw rendezvous.Store, key string, rec []byte) {
	t.Helper()
	if err := raw.Set(ctx, key, rec); err != nil {
		t.Fatal(err)
	}
	if got, err := raw.Get(ctx, key); err != nil || !bytes.Equal(got, rec) {
		t.Fatalf("forging %s: read back %q %v", key, got, err)
	}
}

func TestAuthBoard(t *testing.T) {
	for name, open := range stores(t) {
		t.Run(name, func(t *testing.T) {
			t.Run("await waits past a forged epoch", func(t *testing.T) { testAwaitPastForgery(t, open) })
			t.Run("racing coordinators replace a forged epoch", func(t *testing.T) { testRaceOverForgery(t, open) })
			t.Run("forged notices are skipped", func(t *testing.T) { testForgedNotices(t, open) })
			t.Run("forged respawn tickets spend nothing", func(t *testing.T) { testForgedTickets(t, open) })
		})
	}
}

// testAwaitPastForgery: a forged epoch 1 is on the board before the
// genuine one. Await does not return it and keeps waiting; Lookup and
// Latest do not count it; the coordinator's Publish replaces it; Await
// then returns the genuine epoch. Replays of the genuine record, under
// another key or read in another round, are refused, and an
// unauthenticated Board still reads the sealed records.
func testAwaitPastForgery(t *testing.T, open func() rendezvous.Store) {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	a, forged := testAuth(t, "run/1")
	worker, raw := authBoard(t, open, "await", a)
	coord := NewBoard(open(), "await").Authenticated(a)

	fake := mustNext(t, Initial(4), 0, 1, 3)
	rec, _ := json.Marshal(fake)
	forge(ctx, t, raw, "epoch/1", rec)
	type result struct {
		e   Epoch
		err error
	}
	got := make(chan result, 1)
	go func() {
		e, err := worker.Await(ctx, 1)
		got <- result{e, err}
	}()
	select {
	case r := <-got:
		t.Fatalf("Await returned the forged epoch: %v %v", r.e, r.err)
	case <-time.After(300 * time.Millisecond): // several polls
	}
	if e, ok, err := worker.Lookup(ctx, 1); ok || err != nil {
		t.Errorf("Lookup(1) over a forgery = %v %v %v, want not there", e, ok, err)
	}
	if n, err := worker.Latest(ctx); n != 0 || err != nil {
		t.Errorf("Latest over a forgery = %d %v, want 0", n, err)
	}
	if n, err := NewBoard(open(), "await").Latest(ctx); n != 1 || err != nil {
		t.Errorf("an unauthenticated Latest = %d %v: the forgery is there for it", n, err)
	}

	genuine := mustNext(t, Initial(4), 2)
	if held, won, err := coord.Publish(ctx, genuine); err != nil || !won || !slices.Equal(held.Excluded, []int{2}) {
		t.Fatalf("Publish over a forgery = %v %v %v, want the genuine epoch published", held, won, err)
	}
	select {
	case r := <-got:
		if r.err != nil || !slices.Equal(r.e.Excluded, []int{2}) {
			t.Fatalf("Await = %v %v, want the genuine epoch", r.e, r.err)
		}
	case <-ctx.Done():
		t.Fatal("Await did not return the genuine epoch")
	}
	if e, ok, err := worker.Lookup(ctx, 1); !ok || err != nil || !slices.Equal(e.Excluded, []int{2}) {
		t.Errorf("Lookup(1) = %v %v %v", e, ok, err)
	}
	if n, err := worker.Latest(ctx); n != 1 || err != nil {
		t.Errorf("Latest = %d %v, want 1", n, err)
	}
	if fs := forged(); len(fs) != 1 || fs[0] != (Forgery{Key: "epoch/1", Reason: NoMAC}) {
		t.Errorf("forgeries %v, want the forged epoch 1 once", fs)
	}

	// The genuine record replayed as epoch 2: refused, Await waits.
	sealed, err := raw.Get(ctx, "epoch/1")
	if err != nil {
		t.Fatal(err)
	}
	forge(ctx, t, raw, "epoch/2", sealed)
	short, stop := context.WithTimeout(ctx, 200*time.Millisecond)
	defer stop()
	if e, err := worker.Await(short, 2); err == nil || !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("Await(2) over a replay = %v %v, want it still waiting at the deadline", e, err)
	}
	// The genuine epoch 1 read in the next round.
	next, _ := testAuth(t, "run/2")
	if _, ok, err := NewBoard(open(), "await").Authenticated(next).Lookup(ctx, 1); ok || err != nil {
		t.Errorf("epoch 1 of round 1 read in round 2: %v %v, want it refused", ok, err)
	}
	if fs := forged(); len(fs) != 2 || fs[1] != (Forgery{Key: "epoch/2", Reason: BadMAC}) {
		t.Errorf("forgeries %v, want the replay as epoch 2 second", fs)
	}
	// Readers without the secret parse sealed records as before.
	if e, ok, err := NewBoard(open(), "await").Lookup(ctx, 1); !ok || err != nil || !slices.Equal(e.Excluded, []int{2}) {
		t.Errorf("an unauthenticated Lookup of a sealed epoch = %v %v %v", e, ok, err)
	}
}

// testRaceOverForgery: a forged epoch 1 is on the board, and several
// genuine coordinators publish different epochs 1 at once: exactly one
// wins, and every one holds its epoch.
func testRaceOverForgery(t *testing.T, open func() rendezvous.Store) {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	a, _ := testAuth(t, "run/1")
	_, raw := authBoard(t, open, "race", a)
	forger, _ := NewAuth([]byte("a guess"), "run/1", nil)
	rec, _ := json.Marshal(mustNext(t, Initial(8), 0))
	rec, _ = forger.seal("epoch/1", rec)
	forge(ctx, t, raw, "epoch/1", rec)
	const rivals = 6
	type outcome struct {
		held Epoch
		won  bool
		err  error
	}
	outs := make([]outcome, rivals)
	var wg sync.WaitGroup
	for i := range rivals {
		b, _ := authBoard(t, open, "race", a)
		e := mustNext(t, Initial(8), i+1)
		e.Coordinator = fmt.Sprint("agent", i)
		wg.Go(func() {
			held, won, err := b.Publish(ctx, e)
			outs[i] = outcome{held, won, err}
		})
	}
	wg.Wait()
	winners := 0
	for i, o := range outs {
		if o.err != nil {
			t.Fatalf("rival %d: %v", i, o.err)
		}
		if o.won {
			winners++
		}
		if o.held.Coordinator != outs[0].held.Coordinator || slices.Contains(o.held.Excluded, 0) {
			t.Errorf("rival %d holds %v (by %q), rival 0 holds %v (by %q)", i, o.held, o.held.Coordinator, outs[0].held, outs[0].held.Coordinator)
		}
	}
	if winners != 1 {
		t.Errorf("%d rivals won the publication, want exactly 1", winners)
	}
	if got, err := raw.Get(ctx, "epoch/1"); err != nil || bytes.Equal(got, rec) {
		t.Errorf("epoch 1 still holds the forgery (%v)", err)
	}
}

// testForgedNotices: forgeries written ahead of the genuine notices, under
// indices nobody filed yet, are passed over by the filers (a genuine
// notice goes to the next free index), skipped by Notices and refused by
// AwaitNotice at once; the genuine notices are all read, in order.
func testForgedNotices(t *testing.T, open func() rendezvous.Store) {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	a, forged := testAuth(t, "run/1")
	b, raw := authBoard(t, open, "notices", a)
	if _, err := b.File(ctx, Report{Ranks: []int{1}, Reason: "exited"}); err != nil {
		t.Fatal(err)
	}
	forge(ctx, t, raw, "report/2", []byte(`{"failure":{"ranks":[0,2,3],"reason":"forged"}}`))
	forge(ctx, t, raw, "report/4", []byte(`{"join":{"slots":[0]},"mac":"`+strings.Repeat("0", 64)+`"}`))
	if i, err := b.FileJoin(ctx, Join{Slots: []int{1}}); err != nil || i != 3 {
		t.Fatalf("FileJoin = %d, %v; want index 3, past the forgery at 2", i, err)
	}
	ns, last, err := b.Notices(ctx, 0)
	if err != nil || last != 4 || len(ns) != 2 || ns[0].Failure == nil || !slices.Equal(ns[0].Failure.Ranks, []int{1}) || ns[1].Join == nil {
		t.Fatalf("Notices = %+v %d %v, want the report and the join, the forgeries skipped", ns, last, err)
	}
	start := time.Now()
	if n, err := b.AwaitNotice(ctx, 2); !errors.Is(err, ErrForged) {
		t.Fatalf("AwaitNotice(2) = %+v %v, want ErrForged", n, err)
	}
	if took := time.Since(start); took > time.Second {
		t.Errorf("AwaitNotice took %v to refuse a forgery", took)
	}
	// A reader waiting on the next index gets the genuine notice filed
	// past the forgery at 4.
	got := make(chan Notice, 1)
	errc := make(chan error, 1)
	go func() {
		n, err := b.AwaitNotice(ctx, 5)
		got <- n
		errc <- err
	}()
	other, _ := authBoard(t, open, "notices", a) // a filer that has seen nothing
	if i, err := other.FileJoined(ctx, Joined{Epoch: 2, Slot: 1}); err != nil || i != 5 {
		t.Fatalf("FileJoined = %d, %v; want index 5", i, err)
	}
	if n := <-got; <-errc != nil || n.Joined == nil || n.Joined.Slot != 1 {
		t.Errorf("AwaitNotice(5) = %+v, want the genuine joined notice", n)
	}
	keys := map[string]bool{}
	for _, f := range forged() {
		keys[f.Key] = true
	}
	if len(keys) != 2 || !keys["report/2"] || !keys["report/4"] {
		t.Errorf("forgeries %v, want report/2 and report/4", forged())
	}
}

// testForgedTickets: forged respawn tickets spend nothing: agents take
// them over, and the budget is the job's max genuine respawns, whoever
// takes them.
func testForgedTickets(t *testing.T, open func() rendezvous.Store) {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	a, forged := testAuth(t, "run/1")
	_, raw := authBoard(t, open, "tickets", a)
	for k := 1; k <= 3; k++ {
		forge(ctx, t, raw, fmt.Sprint("respawns/", k), []byte(fmt.Sprintf(`{"ticket":%d}`, k)))
	}
	var taken []int
	for i := range 4 {
		b, _ := authBoard(t, open, "tickets", a) // each respawn by another agent
		n, ok, err := b.TakeRespawn(ctx, 3)
		if err != nil {
			t.Fatal(err)
		}
		if ok != (i < 3) {
			t.Fatalf("respawn %d: ticket %d, within the budget %v; want %v", i+1, n, ok, i < 3)
		}
		if ok {
			taken = append(taken, n)
		}
	}
	if !slices.Equal(taken, []int{1, 2, 3}) {
		t.Errorf("tickets %v, want 1, 2, 3", taken)
	}
	if len(forged()) < 3 {
		t.Errorf("forgeries %v, want the three forged tickets", forged())
	}
}

// TestCoordinatorIgnoresForgeries: agents on authenticated boards. A
// forger files a failure of ranks 0 and 1 and writes an epoch 1 that
// excludes rank 3; the agents decide on the genuine report of rank 2
// alone, publish over the forged epoch, and count the forgeries.
func TestCoordinatorIgnoresForgeries(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	dial := storeDialer(ctx, t)
	a, forged := testAuth(t, "run/3")
	side := func(name string) *Coordinator {
		board := func() *Board { return NewBoard(dial(), "").Authenticated(a) }
		c := NewCoordinator(CoordinatorConfig{Config: Config{SettleWindow: 100 * time.Millisecond}, Name: name, World: 4},
			board(), board(), board())
		t.Cleanup(c.Close)
		return c
	}
	leader, other := side("a"), side("b")
	leader.Lead(ctx, true)
	raw := rendezvous.NewPrefixStore(DefaultPrefix, dial())
	forge(ctx, t, raw, "epoch/1", []byte(`{"epoch":1,"excluded":[3],"lost":[3],"ranks":[0,1,2,-1],"world_size":3,"action":"shrink","base":0}`))
	forge(ctx, t, raw, "report/1", []byte(`{"failure":{"ranks":[0,1],"reason":"forged"}}`))
	if err := other.File(ctx, Report{Ranks: []int{2}, Reason: "exited"}); err != nil {
		t.Fatal(err)
	}
	for _, c := range []*Coordinator{leader, other} {
		e := nextEpoch(t, c, 10*time.Second)
		if e.Number != 1 || !slices.Equal(e.Excluded, []int{2}) || e.Coordinator != "a" {
			t.Fatalf("epoch %v by %q, want epoch 1 excluding rank 2 alone, by a", e, e.Coordinator)
		}
	}
	select {
	case e := <-leader.Epochs():
		t.Errorf("another epoch: %v", e)
	case err := <-leader.Err():
		t.Errorf("the agreement failed: %v", err)
	case <-time.After(300 * time.Millisecond):
	}
	keys := map[string]bool{}
	for _, f := range forged() {
		keys[f.Key] = true
	}
	if !keys["epoch/1"] || !keys["report/1"] || a.Forgeries() != int64(len(forged())) {
		t.Errorf("forgeries %v (%d counted), want epoch/1 and report/1", forged(), a.Forgeries())
	}
}
