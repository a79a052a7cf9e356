package filestore

import (
	"context"
	"errors"
	"regexp"
	"slices"
	"strconv"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"github.com/gorunhq/gorun/rendezvous"
)

// TestSetGetCheck is test_store.py's _test_set_get_check against a FileStore
// with current PyTorch's cleanup rule: 5 user keys plus "refcount/".
func TestSetGetCheck(t *testing.T) {
	s := openStore(t, tempPath(t), testConfig())
	for _, d := range []int64{1, 2, 3} {
		s.add("key", d)
	}
	s.set("key0", "value0")
	s.add("key3", 1)
	s.set("key1", "value1")
	s.add("key3", 2)
	s.set("key2", "value2")
	for _, d := range []int64{3, 4, 5, 6} {
		s.add("key3", d)
	}
	if n := s.numKeys(); n != 6 {
		t.Errorf("NumKeys = %d, want 6", n)
	}
	for k, want := range map[string]string{"key": "6", "key0": "value0", "key1": "value1", "key2": "value2", "key3": "21"} {
		if got := s.get(k); got != want {
			t.Errorf("Get(%q) = %q, want %q", k, got, want)
		}
	}
	if !s.has("key3") || s.has("Randomkey3") {
		t.Error("Check(key3) must be true, Check(Randomkey3) false")
	}
	// Keys starting with "-" are ordinary user keys.
	s.set("-key3", "7")
	if got := s.get("-key3"); got != "7" {
		t.Errorf(`Get("-key3") = %q, want "7"`, got)
	}
	if !s.del("-key3") {
		t.Error(`Delete("-key3") = false`)
	}
	if n := s.numKeys(); n != 6 {
		t.Errorf("NumKeys after deleting -key3 = %d, want 6", n)
	}
	if got := s.keys(); !slices.Equal(got, []string{"key", "key0", "key1", "key2", "key3"}) {
		t.Errorf("ListKeys = %q", got)
	}
}

func TestAdd(t *testing.T) {
	tests := []struct {
		name    string
		initial *string // nil: key absent
		deltas  []int64
		want    int64
		wantErr error
	}{
		{name: "absent counts as 0", deltas: []int64{1, 2, 3}, want: 6},
		{name: "zero delta reads", initial: ptr("41"), deltas: []int64{0}, want: 41},
		{name: "negative", initial: ptr("1"), deltas: []int64{-3}, want: -2},
		{name: "empty value counts as 0 (FileStore, not TCPStore)", initial: ptr(""), deltas: []int64{5}, want: 5},
		{name: "stoll skips space and stops at junk", initial: ptr(" 12abc"), deltas: []int64{1}, want: 13},
		{name: "not a number", initial: ptr("abc"), deltas: []int64{1}, wantErr: rendezvous.ErrNotInteger},
		{name: "overflow", initial: ptr("9223372036854775807"), deltas: []int64{1}, wantErr: rendezvous.ErrNotInteger},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			s := openStore(t, tempPath(t), testConfig())
			if tc.initial != nil {
				s.set("k", *tc.initial)
			}
			var got int64
			var err error
			for _, d := range tc.deltas {
				if got, err = s.Add(t.Context(), "k", d); err != nil {
					break
				}
			}
			if tc.wantErr != nil {
				if !errors.Is(err, tc.wantErr) {
					t.Fatalf("Add error = %v, want %v", err, tc.wantErr)
				}
				return
			}
			check(t, err)
			if got != tc.want {
				t.Fatalf("Add = %d, want %d", got, tc.want)
			}
			if v, want := s.get("k"), strconv.FormatInt(tc.want, 10); v != want {
				t.Fatalf("Get = %q, want %q", v, want)
			}
		})
	}
}

func ptr(s string) *string { return &s }

// TestCompareSet covers c10d's four cases, and checks that only a store
// appends a record.
func TestCompareSet(t *testing.T) {
	tests := []struct {
		name               string
		initial            *string
		expected, desired  string
		want               string
		wantValue          *string // nil: key absent afterwards
		wantAppendedRecord bool
	}{
		{"absent, wrong expected: returns expected", nil, "wrong_old_value", "new", "wrong_old_value", nil, false},
		{"present, wrong expected: returns current", ptr("value0"), "wrong", "new", "value0", ptr("value0"), false},
		{"present, right expected: stores", ptr("value0"), "value0", "new_value0", "new_value0", ptr("new_value0"), true},
		{"absent, empty expected: stores", nil, "", "new_value1", "new_value1", ptr("new_value1"), true},
		{"present empty, empty expected: stores", ptr(""), "", "x", "x", ptr("x"), true},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			path := tempPath(t)
			s := openStore(t, path, testConfig())
			if tc.initial != nil {
				s.set("k", *tc.initial)
			}
			before := len(readFile(t, path))
			if got := s.cas("k", tc.expected, tc.desired); got != tc.want {
				t.Errorf("CompareSet = %q, want %q", got, tc.want)
			}
			if appended := len(readFile(t, path)) > before; appended != tc.wantAppendedRecord {
				t.Errorf("appended a record = %v, want %v", appended, tc.wantAppendedRecord)
			}
			switch {
			case tc.wantValue == nil && s.has("k"):
				t.Error("key exists afterwards")
			case tc.wantValue != nil && s.get("k") != *tc.wantValue:
				t.Errorf("value = %q, want %q", s.get("k"), *tc.wantValue)
			}
		})
	}
}

// TestDelete follows test_store.py's _test_numkeys_delkeys (with
// "refcount/" where TCPStore has "init/"), and checks the existed result.
func TestDelete(t *testing.T) {
	s := openStore(t, tempPath(t), testConfig())
	if n := s.numKeys(); n != 1 {
		t.Fatalf("NumKeys of a fresh store = %d, want 1 (refcount/)", n)
	}
	s.add("key", 1)
	s.add("key", 2)
	s.add("key", 3)
	s.set("key0", "value0")
	s.add("key3", 1)
	s.set("key1", "value1")
	if n := s.numKeys(); n != 5 {
		t.Fatalf("NumKeys = %d, want 5", n)
	}
	if !s.del("key") {
		t.Error("Delete(key) = false for a live key")
	}
	if n := s.numKeys(); n != 4 {
		t.Fatalf("NumKeys = %d, want 4", n)
	}
	ctx, cancel := context.WithTimeout(t.Context(), 100*time.Millisecond)
	defer cancel()
	if _, err := s.Get(ctx, "key"); !errors.Is(err, rendezvous.ErrTimeout) {
		t.Fatalf("Get of a deleted key: %v, want a timeout", err)
	}
	s.del("key0")
	s.del("key3")
	if n := s.numKeys(); n != 2 {
		t.Fatalf("NumKeys = %d, want 2", n)
	}
	s.set("key4", "value2")
	if n := s.numKeys(); n != 3 {
		t.Fatalf("NumKeys = %d, want 3", n)
	}
	if s.del("never") {
		t.Error("Delete(never) = true for an absent key")
	}
}

// TestDeleteWaitsForFile: delete opens without O_CREAT, as c10d does, so it
// waits for the file instead of creating it.
func TestDeleteWaitsForFile(t *testing.T) {
	path := tempPath(t)
	s := openStore(t, path, with(func(c *Config) { c.Cleanup = Cleanup113 }))
	ctx, cancel := context.WithTimeout(t.Context(), 50*time.Millisecond)
	defer cancel()
	_, err := s.Delete(ctx, "k")
	if !errors.Is(err, rendezvous.ErrTimeout) || !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Delete on a missing file: %v, want a timeout", err)
	}
	if exists(t, path) {
		t.Fatal("Delete created the file")
	}
}

func TestAppend(t *testing.T) {
	s := openStore(t, tempPath(t), testConfig())
	ctx := t.Context()
	s.set("foo", "po")
	check(t, s.Append(ctx, "foo", []byte("tato")))
	check(t, s.Append(ctx, "bar", []byte("po")))
	check(t, s.Append(ctx, "bar", []byte("tato")))
	for _, k := range []string{"foo", "bar"} {
		if got := s.get(k); got != "potato" {
			t.Errorf("Get(%q) = %q, want potato", k, got)
		}
	}
}

func TestMultiSetGet(t *testing.T) {
	s := openStore(t, tempPath(t), testConfig())
	ctx := t.Context()
	check(t, s.MultiSet(ctx, []string{"foo", "bar"}, [][]byte{[]byte("po"), []byte("tato")}))
	if got := s.get("foo") + "|" + s.get("bar"); got != "po|tato" {
		t.Errorf("after MultiSet: %q", got)
	}
	s.set("a", "c")
	s.set("b", "d")
	vals, err := s.MultiGet(ctx, "a", "b", "foo")
	check(t, err)
	if got := string(slices.Concat(vals...)); got != "cdpo" || len(vals) != 3 {
		t.Errorf("MultiGet = %q", vals)
	}
	err = s.MultiSet(ctx, []string{"x"}, nil)
	if !errors.Is(err, rendezvous.ErrInvalidArgument) {
		t.Errorf("MultiSet with mismatched lengths: %v", err)
	}
}

// TestTimeouts: a 1 s store timeout ends every blocking operation in 1 s
// (PyTorch's tests allow < 3 s), with c10d's message, matching both
// rendezvous.ErrTimeout and context.DeadlineExceeded. A context deadline
// overrides the store timeout, and the message quotes it.
func TestTimeouts(t *testing.T) {
	tests := []struct {
		name     string
		ctxLimit time.Duration // 0: none, the store's 1 s applies
		op       func(ctx context.Context, s *Store) error
		msg      string // a regexp
		min      time.Duration
	}{
		{"get", 0, func(ctx context.Context, s *Store) error { _, err := s.Get(ctx, "nonexistent key"); return err },
			"filestore: Timeout waiting for key: nonexistent key after 1000 ms", time.Second},
		{"multi_get names the missing key", 0, func(ctx context.Context, s *Store) error {
			_, err := s.MultiGet(ctx, "present", "absent")
			return err
		}, "filestore: Timeout waiting for key: absent after 1000 ms", time.Second},
		{"wait", 0, func(ctx context.Context, s *Store) error { return s.Wait(ctx, "bad_key") },
			"filestore: Wait timeout", time.Second},
		{"wait, context deadline", 250 * time.Millisecond, func(ctx context.Context, s *Store) error { return s.Wait(ctx, "bad_key") },
			"filestore: Wait timeout", 250 * time.Millisecond},
		{"get, context deadline", 200 * time.Millisecond, func(ctx context.Context, s *Store) error { _, err := s.Get(ctx, "k"); return err },
			"filestore: Timeout waiting for key: k after (1[0-9]{2}|200) ms", 200 * time.Millisecond}, // what was left of 200 ms
		{"barrier", 0, func(ctx context.Context, s *Store) error { return s.Barrier(ctx, "b", 2) },
			"filestore: Barrier timeout: key b reached 1 of 2 after 1000 ms", time.Second},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			s := openStore(t, tempPath(t), with(func(c *Config) { c.Timeout = time.Second }))
			s.set("present", "1")
			ctx := t.Context()
			if tc.ctxLimit > 0 {
				var cancel context.CancelFunc
				ctx, cancel = context.WithTimeout(ctx, tc.ctxLimit)
				defer cancel()
			}
			start := time.Now()
			err := tc.op(ctx, s.Store)
			elapsed := time.Since(start)
			if !errors.Is(err, rendezvous.ErrTimeout) || !errors.Is(err, context.DeadlineExceeded) {
				t.Fatalf("error %v: want ErrTimeout and DeadlineExceeded", err)
			}
			if !regexp.MustCompile("^" + tc.msg + "$").MatchString(err.Error()) {
				t.Errorf("message %q, want %q", err, tc.msg)
			}
			if elapsed < tc.min || elapsed > 3*time.Second {
				t.Errorf("took %v, want %v..3s", elapsed, tc.min)
			}
		})
	}
}

// TestDefaultTimeout: with no deadline and no configured timeout, a Get
// gives up after c10d's 300 s (on synctest's fake clock).
func TestDefaultTimeout(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		cfg := Config{WorldSize: -1, Cleanup: Cleanup113, PollInterval: time.Second} // coarse polling keeps the loop short
		s, err := Open(t.Context(), tempPath(t), cfg)
		check(t, err)
		defer s.Close()
		start := time.Now()
		_, err = s.Get(context.Background(), "k")
		if got, want := time.Since(start), rendezvous.DefaultTimeout; got != want {
			t.Errorf("gave up after %v, want %v", got, want)
		}
		if want := "filestore: Timeout waiting for key: k after 300000 ms"; err == nil || err.Error() != want {
			t.Errorf("error %v, want %q", err, want)
		}
	})
}

// TestWaitForFile: readers wait for the file to be created, as c10d's do
// when another rank is still starting.
func TestWaitForFile(t *testing.T) {
	path := tempPath(t)
	reader := openStore(t, path, with(func(c *Config) { c.Cleanup = Cleanup113 }))
	got := make(chan string, 1)
	go func() {
		v, err := reader.Get(t.Context(), "k")
		if err != nil {
			got <- "error: " + err.Error()
			return
		}
		got <- string(v)
	}()
	time.Sleep(50 * time.Millisecond)
	if exists(t, path) {
		t.Fatal("a reader created the file")
	}
	writer := openStore(t, path, testConfig())
	writer.set("k", "v")
	select {
	case v := <-got:
		if v != "v" {
			t.Fatalf("Get = %q", v)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("Get did not return after the key was set")
	}
}

// TestMultiThreadedWait is test_store.py's TestMultiThreadedWait with two
// Stores on one file.
func TestMultiThreadedWait(t *testing.T) {
	path := tempPath(t)
	a := openStore(t, path, testConfig())
	b := openStore(t, path, testConfig())
	var wg sync.WaitGroup
	wg.Go(func() {
		if err := a.Wait(t.Context(), "key1"); err != nil {
			t.Errorf("Wait: %v", err)
			return
		}
		if v := a.get("key1"); v != "value1" {
			t.Errorf("Get = %q", v)
		}
	})
	time.Sleep(30 * time.Millisecond)
	b.set("key1", "value1")
	wg.Wait()
}

// TestCancel: cancelling the context stops a waiting operation at once,
// with context.Canceled and not a timeout.
func TestCancel(t *testing.T) {
	tests := []struct {
		name string
		op   func(context.Context, *Store) error
	}{
		{"get", func(ctx context.Context, s *Store) error { _, err := s.Get(ctx, "k"); return err }},
		{"wait", func(ctx context.Context, s *Store) error { return s.Wait(ctx, "k") }},
		{"barrier", func(ctx context.Context, s *Store) error { return s.Barrier(ctx, "b", 2) }},
		{"delete, waiting for the file", func(ctx context.Context, s *Store) error { _, err := s.Delete(ctx, "k"); return err }},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			path := tempPath(t)
			s := openStore(t, path, with(func(c *Config) { c.Cleanup = Cleanup113 }))
			ctx, cancel := context.WithCancel(t.Context())
			time.AfterFunc(50*time.Millisecond, cancel)
			start := time.Now()
			err := tc.op(ctx, s.Store)
			if !errors.Is(err, context.Canceled) || errors.Is(err, rendezvous.ErrTimeout) {
				t.Fatalf("error %v, want context.Canceled", err)
			}
			if d := time.Since(start); d > time.Second {
				t.Fatalf("returned %v after the cancel", d)
			}
		})
	}
}

// TestClose: Close stops waiting operations with ErrClosed, later operations
// fail with ErrClosed, and a second Close is a no-op.
func TestClose(t *testing.T) {
	path := tempPath(t)
	s := openStore(t, path, testConfig())
	s.set("k", "v")
	errc := make(chan error, 1)
	go func() { _, err := s.Get(context.Background(), "absent"); errc <- err }()
	time.Sleep(30 * time.Millisecond)
	check(t, s.Close())
	select {
	case err := <-errc:
		if !errors.Is(err, rendezvous.ErrClosed) {
			t.Fatalf("waiting Get: %v, want ErrClosed", err)
		}
	case <-time.After(2 * time.Second):
		t.Fatal("Close did not stop a waiting Get")
	}
	size := len(readFile(t, path))
	ctx := t.Context()
	ops := map[string]func() error{
		"set":      func() error { return s.Set(ctx, "k", nil) },
		"get":      func() error { _, err := s.Get(ctx, "k"); return err },
		"add":      func() error { _, err := s.Add(ctx, "n", 1); return err },
		"cas":      func() error { _, err := s.CompareSet(ctx, "k", nil, nil); return err },
		"delete":   func() error { _, err := s.Delete(ctx, "k"); return err },
		"check":    func() error { _, err := s.Check(ctx, "k"); return err },
		"wait":     func() error { return s.Wait(ctx, "k") },
		"num_keys": func() error { _, err := s.NumKeys(ctx); return err },
		"list":     func() error { _, err := s.ListKeys(ctx); return err },
		"append":   func() error { return s.Append(ctx, "k", nil) },
		"barrier":  func() error { return s.Barrier(ctx, "b", 1) },
	}
	for name, op := range ops {
		if err := op(); !errors.Is(err, rendezvous.ErrClosed) {
			t.Errorf("%s after Close: %v, want ErrClosed", name, err)
		}
	}
	check(t, s.Close())
	if got := len(readFile(t, path)); got != size {
		t.Errorf("the file grew from %d to %d bytes after Close", size, got)
	}
}

func TestQueuesNotSupported(t *testing.T) {
	s := openStore(t, tempPath(t), testConfig())
	ctx := t.Context()
	errs := []error{s.QueuePush(ctx, "q", nil)}
	_, err := s.QueuePop(ctx, "q", false)
	errs = append(errs, err)
	_, err = s.QueueLen(ctx, "q")
	errs = append(errs, err)
	for i, err := range errs {
		if !errors.Is(err, rendezvous.ErrNotSupported) {
			t.Errorf("queue op %d: %v, want ErrNotSupported", i, err)
		}
	}
}

func TestBarrier(t *testing.T) {
	const n = 4
	path := tempPath(t)
	var wg sync.WaitGroup
	for range n {
		s := openStore(t, path, testConfig())
		wg.Go(func() {
			if err := s.Barrier(t.Context(), "barrier", n); err != nil {
				t.Errorf("Barrier: %v", err)
			}
		})
	}
	wg.Wait()
	s := openStore(t, path, testConfig())
	if v := s.get("barrier"); v != "4" {
		t.Errorf("counter = %q, want 4", v)
	}
	// The counter stays, so a later barrier on it passes at once.
	check(t, s.Barrier(t.Context(), "barrier", n))
	if err := s.Barrier(t.Context(), "barrier", 0); !errors.Is(err, rendezvous.ErrInvalidArgument) {
		t.Errorf("Barrier(0): %v, want ErrInvalidArgument", err)
	}
}

// TestPrefixStore: a PrefixStore over a FileStore behaves as c10d's
// PrefixFileStore in test_store.py.
func TestPrefixStore(t *testing.T) {
	path := tempPath(t)
	fs := openStore(t, path, testConfig())
	p := rendezvous.NewPrefixStore("testPrefix", fs.Store)
	ctx := t.Context()
	for _, d := range []int64{1, 2, 3} {
		_, err := p.Add(ctx, "key", d)
		check(t, err)
	}
	check(t, p.Set(ctx, "key0", []byte("value0")))
	if n, err := p.NumKeys(ctx); err != nil || n != 3 { // /testPrefix/key, /testPrefix/key0, refcount/
		t.Fatalf("NumKeys = %d, %v; want 3", n, err)
	}
	if v := fs.get("testPrefix/key"); v != "6" {
		t.Errorf("underlying testPrefix/key = %q", v)
	}
	keys, err := p.ListKeys(ctx)
	check(t, err)
	if !slices.Equal(keys, []string{"key", "key0"}) {
		t.Errorf("ListKeys = %q", keys)
	}
}

func TestOpenRejects(t *testing.T) {
	if _, err := Open(t.Context(), "", DefaultConfig()); !errors.Is(err, rendezvous.ErrInvalidArgument) {
		t.Errorf("empty path: %v", err)
	}
	cfg := DefaultConfig()
	cfg.Cleanup = 7
	if _, err := Open(t.Context(), tempPath(t), cfg); !errors.Is(err, rendezvous.ErrInvalidArgument) {
		t.Errorf("unknown cleanup: %v", err)
	}
}
