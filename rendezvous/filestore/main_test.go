package filestore

import (
	"bytes"
	"context"
	"encoding/binary"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"testing"
	"time"

	"go.uber.org/goleak"
)

// The test binary doubles as the "other process" of the multi-process tests:
// started with helperEnv set, it runs a helper instead of the tests.
const (
	helperEnv     = "GORUN_FILESTORE_TEST_HELPER"
	helperPathEnv = "GORUN_FILESTORE_TEST_PATH"
	helperNEnv    = "GORUN_FILESTORE_TEST_N"

	helperAdds = 300 // adds per party in TestConcurrentAddsAcrossProcesses
)

func TestMain(m *testing.M) {
	if mode := os.Getenv(helperEnv); mode != "" {
		if err := runHelper(mode, os.Getenv(helperPathEnv), os.Getenv(helperNEnv)); err != nil {
			fmt.Fprintln(os.Stderr, "helper:", err)
			os.Exit(1)
		}
		os.Exit(0)
	}
	goleak.VerifyTestMain(m)
}

// runHelper is the body of a helper process.
//
//	add:  Barrier("start", n), then helperAdds times Add("counter", 1),
//	      printing each result on its own line
//	echo: Get("ping"), then Set("pong", value+"!")
func runHelper(mode, path, n string) error {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	s, err := Open(ctx, path, helperConfig())
	if err != nil {
		return err
	}
	defer s.Close()
	switch mode {
	case "add":
		parties, err := strconv.Atoi(n)
		if err != nil {
			return err
		}
		if err := s.Barrier(ctx, "start", int64(parties)); err != nil {
			return err
		}
		for range helperAdds {
			v, err := s.Add(ctx, "counter", 1)
			if err != nil {
				return err
			}
			fmt.Println(v)
		}
	case "echo":
		v, err := s.Get(ctx, "ping")
		if err != nil {
			return err
		}
		return s.Set(ctx, "pong", append(v, '!'))
	default:
		return fmt.Errorf("unknown helper mode %q", mode)
	}
	return s.Close()
}

// testConfig is c10d's defaults with a store timeout short enough that a
// broken test fails in seconds, not five minutes.
func testConfig() Config {
	c := DefaultConfig()
	c.Timeout = 10 * time.Second
	return c
}

// helperConfig polls fast, so that the parties of a multi-process test leave
// their start barrier together.
func helperConfig() Config {
	c := testConfig()
	c.PollInterval = time.Millisecond
	return c
}

func with(mut func(*Config)) Config {
	c := testConfig()
	mut(&c)
	return c
}

func tempPath(t testing.TB) string { return filepath.Join(t.TempDir(), "store") }

// openStore opens a Store that the test's cleanup closes.
func openStore(t testing.TB, path string, cfg Config) tstore {
	t.Helper()
	s, err := Open(t.Context(), path, cfg)
	if err != nil {
		t.Fatalf("Open: %v", err)
	}
	t.Cleanup(func() { _ = s.Close() })
	return tstore{t, s}
}

// rec encodes a record independently of the package's encoder, so the tests
// check the format against the spec rather than against itself.
func rec(key, value string) []byte {
	var b bytes.Buffer
	_ = binary.Write(&b, binary.LittleEndian, uint32(len(key)))
	b.WriteString(key)
	_ = binary.Write(&b, binary.LittleEndian, uint32(len(value)))
	b.WriteString(value)
	return b.Bytes()
}

func recs(kv ...string) []byte {
	var out []byte
	for i := 0; i < len(kv); i += 2 {
		out = append(out, rec(kv[i], kv[i+1])...)
	}
	return out
}

func readFile(t testing.TB, path string) []byte {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func writeFile(t testing.TB, path string, b []byte) {
	t.Helper()
	if err := os.WriteFile(path, b, 0o644); err != nil {
		t.Fatal(err)
	}
}

func appendFile(t testing.TB, path string, b []byte) {
	t.Helper()
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_APPEND|os.O_CREATE, 0o644)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if _, err := f.Write(b); err != nil {
		t.Fatal(err)
	}
}

func exists(t testing.TB, path string) bool {
	t.Helper()
	_, err := os.Stat(path)
	if err != nil && !os.IsNotExist(err) {
		t.Fatal(err)
	}
	return err == nil
}

// tstore wraps a Store for tests: each method fails the test on error.
type tstore struct {
	t testing.TB
	*Store
}

func (s tstore) fatal(op string, err error) {
	s.t.Helper()
	if err != nil {
		s.t.Fatalf("%s: %v", op, err)
	}
}

func (s tstore) set(k, v string) {
	s.t.Helper()
	s.fatal("Set "+k, s.Set(s.t.Context(), k, []byte(v)))
}

func (s tstore) get(k string) string {
	s.t.Helper()
	v, err := s.Get(s.t.Context(), k)
	s.fatal("Get "+k, err)
	return string(v)
}

func (s tstore) add(k string, delta int64) int64 {
	s.t.Helper()
	n, err := s.Add(s.t.Context(), k, delta)
	s.fatal("Add "+k, err)
	return n
}

func (s tstore) cas(k, expected, desired string) string {
	s.t.Helper()
	v, err := s.CompareSet(s.t.Context(), k, []byte(expected), []byte(desired))
	s.fatal("CompareSet "+k, err)
	return string(v)
}

func (s tstore) del(k string) bool {
	s.t.Helper()
	ok, err := s.Delete(s.t.Context(), k)
	s.fatal("Delete "+k, err)
	return ok
}

func (s tstore) has(keys ...string) bool {
	s.t.Helper()
	ok, err := s.Check(s.t.Context(), keys...)
	s.fatal("Check", err)
	return ok
}

func (s tstore) numKeys() int64 {
	s.t.Helper()
	n, err := s.NumKeys(s.t.Context())
	s.fatal("NumKeys", err)
	return n
}

func (s tstore) keys() []string {
	s.t.Helper()
	k, err := s.ListKeys(s.t.Context())
	s.fatal("ListKeys", err)
	return k
}

func check(t testing.TB, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}
