package filestore

import (
	"bytes"
	"errors"
	"maps"
	"os"
	"slices"
	"testing"
)

// captured113 is the file PyTorch 1.13 wrote for `set a hello; add cnt 3;
// add cnt 4; compare_set c "" → x; compare_set c x → y; delete a`
// (captured113Ops) and then its destructor with world_size -1
// (captured113Close), from spec/c10d-wire.md §3.1, spelled out byte by byte.
const (
	captured113Ops = "" +
		"\x02\x00\x00\x00/a" + "\x05\x00\x00\x00hello" +
		"\x04\x00\x00\x00/cnt" + "\x01\x00\x00\x003" +
		"\x04\x00\x00\x00/cnt" + "\x01\x00\x00\x007" +
		"\x02\x00\x00\x00/c" + "\x01\x00\x00\x00x" +
		"\x02\x00\x00\x00/c" + "\x01\x00\x00\x00y" +
		"\x03\x00\x00\x00-/a" + "\x00\x00\x00\x00"
	captured113Close = "\x08\x00\x00\x00cleanup/" + "\x01\x00\x00\x001"
	captured113      = captured113Ops + captured113Close
)

// runCaptured113Sequence performs the captured sequence on s.
func runCaptured113Sequence(t *testing.T, s tstore) {
	t.Helper()
	s.set("a", "hello")
	if n := s.add("cnt", 3); n != 3 {
		t.Fatalf("add cnt 3 = %d", n)
	}
	if n := s.add("cnt", 4); n != 7 {
		t.Fatalf("add cnt 4 = %d", n)
	}
	if v := s.cas("c", "", "x"); v != "x" {
		t.Fatalf("cas c ''→x = %q", v)
	}
	if v := s.cas("c", "x", "y"); v != "y" {
		t.Fatalf("cas c x→y = %q", v)
	}
	if !s.del("a") {
		t.Fatal("delete a: existed = false")
	}
}

func TestCaptured113Bytes(t *testing.T) {
	path := tempPath(t)
	s := openStore(t, path, with(func(c *Config) { c.Cleanup, c.WorldSize = Cleanup113, -1 }))
	runCaptured113Sequence(t, s)
	if got := readFile(t, path); !bytes.Equal(got, []byte(captured113Ops)) {
		t.Fatalf("before Close:\n got %q\nwant %q", got, captured113Ops)
	}
	check(t, s.Close())
	if got := readFile(t, path); !bytes.Equal(got, []byte(captured113)) {
		t.Fatalf("after Close:\n got %q\nwant %q", got, captured113)
	}
}

func TestNewestOpenWritesRefcount(t *testing.T) {
	path := tempPath(t)
	s := openStore(t, path, testConfig())
	if got, want := readFile(t, path), rec("refcount/", "1"); !bytes.Equal(got, want) {
		t.Fatalf("after Open: got %q, want %q", got, want)
	}
	check(t, s.Close())
	want := recs("refcount/", "1", "cleanup/", "1", "refcount/", "0")
	if got := readFile(t, path); !bytes.Equal(got, want) {
		t.Fatalf("after Close: got %q, want %q", got, want)
	}
}

func TestReadCaptured113File(t *testing.T) {
	path := tempPath(t)
	writeFile(t, path, []byte(captured113))
	s := openStore(t, path, with(func(c *Config) { c.Cleanup = Cleanup113 }))
	for k, want := range map[string]string{"cnt": "7", "c": "y"} {
		if got := s.get(k); got != want {
			t.Errorf("Get(%q) = %q, want %q", k, got, want)
		}
	}
	if s.has("a") {
		t.Error(`Check("a") = true after its tombstone`)
	}
	if n := s.numKeys(); n != 3 { // /cnt, /c, cleanup/
		t.Errorf("NumKeys = %d, want 3", n)
	}
	if keys := s.keys(); !slices.Equal(keys, []string{"c", "cnt"}) {
		t.Errorf("ListKeys = %q", keys)
	}
}

// TestReplay feeds hand-written files to a fresh Store and compares the table
// it replays.
func TestReplay(t *testing.T) {
	tests := []struct {
		name string
		file []byte
		want map[string]string
	}{
		{"empty", nil, map[string]string{}},
		{"last record wins", recs("/k", "1", "/k", "2", "/j", "x", "/k", "3"),
			map[string]string{"/k": "3", "/j": "x"}},
		{"tombstone removes", recs("/k", "1", "-/k", ""), map[string]string{}},
		{"set after tombstone", recs("/k", "1", "-/k", "", "/k", "2"), map[string]string{"/k": "2"}},
		{"tombstone of absent key", recs("-/nope", ""), map[string]string{}},
		{"dash user key is not a tombstone", recs("/-k", "7", "/k", "1"),
			map[string]string{"/-k": "7", "/k": "1"}},
		{"tombstone of dash user key", recs("/-k", "7", "/k", "1", "-/-k", ""), map[string]string{"/k": "1"}},
		{"any leading dash is a tombstone", recs("cleanup/", "1", "-cleanup/", ""), map[string]string{}},
		{"internal keys", recs("refcount/", "1", "cleanup/", "2", "/x", "y"),
			map[string]string{"refcount/": "1", "cleanup/": "2", "/x": "y"}},
		{"empty key and value", recs("/", ""), map[string]string{"/": ""}},
		{"binary", recs("/b", "\x00\xff\x00"), map[string]string{"/b": "\x00\xff\x00"}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			path := tempPath(t)
			writeFile(t, path, tc.file)
			s := openStore(t, path, with(func(c *Config) { c.Cleanup = Cleanup113 }))
			if n := s.numKeys(); n != int64(len(tc.want)) {
				t.Errorf("NumKeys = %d, want %d", n, len(tc.want))
			}
			if !maps.Equal(s.tab.kv, tc.want) {
				t.Errorf("table = %q, want %q", s.tab.kv, tc.want)
			}
			if s.tab.offset != int64(len(tc.file)) {
				t.Errorf("offset = %d, want %d", s.tab.offset, len(tc.file))
			}
		})
	}
}

// TestReplayReadsOnlyTheTail appends behind a Store's back and checks that it
// picks up exactly the new records.
func TestReplayReadsOnlyTheTail(t *testing.T) {
	path := tempPath(t)
	writeFile(t, path, recs("/a", "1"))
	s := openStore(t, path, with(func(c *Config) { c.Cleanup = Cleanup113 }))
	if v := s.get("a"); v != "1" {
		t.Fatalf("Get(a) = %q", v)
	}
	// Overwrite the replayed prefix in place: a Store that re-read from 0
	// would see "/z" instead of "/a".
	f, err := os.OpenFile(path, os.O_WRONLY, 0)
	check(t, err)
	_, err = f.WriteAt([]byte("/z"), 4)
	check(t, err)
	check(t, f.Close())
	appendFile(t, path, recs("/b", "2", "-/a", ""))
	if v := s.get("b"); v != "2" {
		t.Fatalf("Get(b) = %q", v)
	}
	if s.has("a") {
		t.Error("a still live after a tombstone appended by someone else")
	}
	if s.has("z") {
		t.Error("the replayed prefix was read again")
	}
}

// TestReplacedFile: after the file is removed and recreated, a Store serves
// the new file's keys, not its cache of the old one.
func TestReplacedFile(t *testing.T) {
	path := tempPath(t)
	s := openStore(t, path, with(func(c *Config) { c.Cleanup = Cleanup113 }))
	s.set("old", "1")
	s.set("old2", "2")
	check(t, os.Remove(path))
	writeFile(t, path, recs("/new", "3"))
	if s.has("old") {
		t.Error("old key survived the file's replacement")
	}
	if v := s.get("new"); v != "3" {
		t.Errorf("Get(new) = %q", v)
	}
}

func TestCorruptFile(t *testing.T) {
	whole := recs("/a", "1", "/b", "2")
	tests := []struct {
		name string
		file []byte
	}{
		{"torn header", whole[:len(whole)-len(rec("/b", "2"))+2]},
		{"torn key", whole[:len(whole)-len(rec("/b", "2"))+5]},
		{"torn value", whole[:len(whole)-1]},
		{"huge length", append(recs("/a", "1"), 0xff, 0xff, 0xff, 0x7f, '/')},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			path := tempPath(t)
			writeFile(t, path, tc.file)
			s := openStore(t, path, with(func(c *Config) { c.Cleanup = Cleanup113 }))
			_, err := s.NumKeys(t.Context())
			if !errors.Is(err, ErrCorrupt) {
				t.Fatalf("NumKeys error = %v, want ErrCorrupt", err)
			}
			// The whole records before the damage were still applied.
			if v := s.tab.kv["/a"]; v != "1" {
				t.Errorf("/a = %q, want 1", v)
			}
		})
	}
}

// FuzzRecords: any bytes either decode into records whose encoding is those
// bytes again, or fail part-way; nothing panics, and a damaged length never
// allocates past the input.
func FuzzRecords(f *testing.F) {
	f.Add([]byte(captured113))
	f.Add(recs("/a", "1", "-/a", "", "refcount/", "0"))
	f.Add([]byte{0xff, 0xff, 0xff, 0xff, '/'})
	f.Fuzz(func(t *testing.T, b []byte) {
		r := bytes.NewReader(b)
		var out []byte
		for off := int64(0); off < int64(len(b)); {
			rec, n, err := readRecord(r, int64(len(b))-off)
			if err != nil {
				return
			}
			if out, err = appendRecord(out, rec); err != nil {
				t.Fatal(err)
			}
			off += n
		}
		if !bytes.Equal(out, b) {
			t.Fatalf("decoded and re-encoded %q as %q", b, out)
		}
	})
}
