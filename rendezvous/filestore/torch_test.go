package filestore

import (
	"bytes"
	"encoding/json"
	"path/filepath"
	"strconv"
	"testing"
	"time"

	"github.com/gorunhq/gorun/internal/torchtest"
)

// The torch tests share files with a real PyTorch FileStore. Starting Python
// costs seconds, so each test runs one script that does several checks and
// reports them as JSON.

// torchExchange: PyTorch writes, Go reads (released by PyTorch's set); Go
// writes, PyTorch reads (its wait released by Go's set) and continues a Go
// counter; then both add to one counter at the same time.
const torchExchange = `
import datetime, json, sys
import torch.distributed as dist
s = dist.FileStore(sys.argv[1], -1)
s.set_timeout(datetime.timedelta(seconds=20))
s.set("t/str", "hello")
s.add("t/cnt", 3)
s.add("t/cnt", 4)
s.compare_set("t/cas", "", "x")
s.compare_set("t/cas", "x", "y")
s.compare_set("t/cas", "nope", "z")
s.set("t/gone", "1")
s.delete_key("t/gone")
s.set("-t/dash", "7")
s.set("t/bin", b"\x00\xff")
out = {"torch_num_keys": s.num_keys()}
s.set("t/done", "1")
s.wait(["go/done"])
out["str"] = s.get("go/str").decode()
out["cnt"] = s.add("go/cnt", 2)
out["cas"] = s.get("go/cas").decode()
out["app"] = s.get("go/app").decode()
out["multi"] = [s.get("go/m1").decode(), s.get("go/m2").decode()]
def live(keys):
    # 1.13's Python binding has no check(), and its wait rounds the elapsed
    # time to whole seconds. compare_set with an impossible expected value
    # never stores, and returns that value exactly when the key is absent.
    probe = b"\x00absent"
    return all(s.compare_set(k, probe, b"") != probe for k in keys)
out["check_live"] = live(["go/str", "go/cnt"])
out["check_deleted"] = live(["go/gone"])
out["num_keys"] = s.num_keys()
s.set("mix/start", "")
out["mix"] = [s.add("mix/cnt", 1) for _ in range(300)]
print(json.dumps(out))
del s  # the destructor appends cleanup/
`

const torchMixAdds = 300 // as in the script

func TestTorchExchange(t *testing.T) {
	torchtest.Python(t)
	t.Parallel()
	path := tempPath(t)
	proc := torchtest.Start(t, nil, torchExchange, path)
	s := openStore(t, path, with(func(c *Config) { c.Cleanup, c.Timeout = Cleanup113, 30*time.Second }))

	// Torch → Go. The file may not exist yet: Get waits for it, then for
	// the key.
	s.get("t/done")
	for k, want := range map[string]string{"t/str": "hello", "t/cnt": "7", "t/cas": "y", "-t/dash": "7", "t/bin": "\x00\xff"} {
		if got := s.get(k); got != want {
			t.Errorf("Go Get(%q) of a torch write = %q, want %q", k, got, want)
		}
	}
	if s.has("t/gone") {
		t.Error("a key torch deleted is live in Go")
	}
	goNumKeys := s.numKeys()

	// Go → torch.
	ctx := t.Context()
	s.set("go/str", "héllo")
	s.add("go/cnt", 5)
	s.cas("go/cas", "", "a")
	s.cas("go/cas", "a", "b")
	s.set("go/gone", "x")
	s.del("go/gone")
	s.set("go/app", "po")
	check(t, s.Append(ctx, "go/app", []byte("tato")))
	check(t, s.MultiSet(ctx, []string{"go/m1", "go/m2"}, [][]byte{[]byte("po"), []byte("tato")}))
	s.set("go/done", "1")

	s.get("mix/start")
	var mix []int64
	for range torchMixAdds {
		mix = append(mix, s.add("mix/cnt", 1))
	}

	var got struct {
		TorchNumKeys int64    `json:"torch_num_keys"`
		Str          string   `json:"str"`
		Cnt          int64    `json:"cnt"`
		Cas          string   `json:"cas"`
		App          string   `json:"app"`
		Multi        []string `json:"multi"`
		CheckLive    bool     `json:"check_live"`
		CheckDeleted bool     `json:"check_deleted"`
		NumKeys      int64    `json:"num_keys"`
		Mix          []int64  `json:"mix"`
	}
	out := proc.Wait(t, 30*time.Second)
	if err := json.Unmarshal([]byte(out), &got); err != nil {
		t.Fatalf("python output %q: %v", out, err)
	}
	if goNumKeys != got.TorchNumKeys+1 { // + t/done
		t.Errorf("Go NumKeys = %d, torch num_keys = %d before t/done", goNumKeys, got.TorchNumKeys)
	}
	if got.Str != "héllo" || got.Cnt != 7 || got.Cas != "b" || got.App != "potato" ||
		len(got.Multi) != 2 || got.Multi[0] != "po" || got.Multi[1] != "tato" {
		t.Errorf("torch read Go's writes as %+v", got)
	}
	if !got.CheckLive || got.CheckDeleted {
		t.Errorf("torch check: live %v (want true), deleted %v (want false)", got.CheckLive, got.CheckDeleted)
	}
	assertOneToN(t, append(mix, got.Mix...), 2*torchMixAdds)
	if v := s.get("go/cnt"); v != "7" {
		t.Errorf("Go Get of the counter torch continued = %q, want 7", v)
	}
	if n := s.numKeys(); n != got.NumKeys+3 { // + mix/start, mix/cnt, torch's cleanup/
		t.Errorf("NumKeys: Go %d, torch %d before its destructor", n, got.NumKeys)
	}
	check(t, s.do(ctx, readAccess, func(tx *txn) error {
		if c, _ := tx.value(cleanupKey); c != "1" {
			t.Errorf("cleanup/ after torch's destructor = %q, want 1", c)
		}
		return nil
	}))
}

// torchFiles: on file A, the captured 1.13 sequence; on files C and D, a
// FileStore(path, 2) sharing the file with a Go Store (Cleanup113, world
// size 2). Go closes C after torch, and D before torch.
const torchFiles = `
import json, os, sys
import torch.distributed as dist
a, c, d = sys.argv[1:4]
s = dist.FileStore(a, -1)
s.set("a", "hello")
s.add("cnt", 3)
s.add("cnt", 4)
s.compare_set("c", "", "x")
s.compare_set("c", "x", "y")
s.delete_key("a")
del s
out = {}
for name, path in (("c", c), ("d", d)):
    s = dist.FileStore(path, 2)
    out[name + "_value"] = s.get("k").decode()
    del s
    out[name + "_exists"] = os.path.exists(path)
print(json.dumps(out))
`

func TestTorchFilesAndCleanup(t *testing.T) {
	torchtest.Python(t)
	t.Parallel()
	dir := t.TempDir()
	pathA, pathB := filepath.Join(dir, "a"), filepath.Join(dir, "b")
	pathC, pathD := filepath.Join(dir, "c"), filepath.Join(dir, "d")
	cfg := with(func(c *Config) { c.Cleanup, c.WorldSize = Cleanup113, 2 })
	goC := openStore(t, pathC, cfg)
	goC.set("k", "from go")
	goD := openStore(t, pathD, cfg)
	goD.set("k", "from go")
	check(t, goD.Close())
	if !exists(t, pathD) {
		t.Fatal("D removed after one of two closes")
	}

	proc := torchtest.Start(t, nil, torchFiles, pathA, pathC, pathD)
	goB := openStore(t, pathB, with(func(c *Config) { c.Cleanup, c.WorldSize = Cleanup113, -1 }))
	runCaptured113Sequence(t, goB)
	check(t, goB.Close())

	var got struct {
		CValue  string `json:"c_value"`
		CExists bool   `json:"c_exists"`
		DValue  string `json:"d_value"`
		DExists bool   `json:"d_exists"`
	}
	out := proc.Wait(t, 30*time.Second)
	if err := json.Unmarshal([]byte(out), &got); err != nil {
		t.Fatalf("python output %q: %v", out, err)
	}

	torchBytes, goBytes := readFile(t, pathA), readFile(t, pathB)
	if !bytes.Equal(torchBytes, goBytes) {
		t.Errorf("same sequence, different files:\ntorch %q\n   go %q", torchBytes, goBytes)
	}
	if !bytes.Equal(torchBytes, []byte(captured113)) {
		t.Errorf("torch's file differs from the capture in the spec:\n got %q\nwant %q", torchBytes, captured113)
	}

	if got.CValue != "from go" || got.DValue != "from go" {
		t.Errorf("torch read %q and %q, want Go's value", got.CValue, got.DValue)
	}
	if !got.CExists {
		t.Error("C removed when torch closed first, with Go's store still open")
	}
	if got.DExists {
		t.Error("D not removed by torch, the second of two closes")
	}
	if !exists(t, pathC) {
		t.Fatal("C gone before Go closed")
	}
	check(t, goC.Close())
	if exists(t, pathC) {
		t.Errorf("C still exists after both closed; cleanup/ = %s", strconv.Quote(string(readFile(t, pathC))))
	}
}
