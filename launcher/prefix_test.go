package launcher

import (
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"
)

func TestExpandTemplate(t *testing.T) {
	vars := map[string]string{"role_name": "trainer", "local_rank": "3", "rank": "11", "hostname": "r12i0n8"}
	for _, tc := range []struct{ in, want string }{
		{defaultLinePrefix, "[trainer3]:"},
		{"${hostname}:${rank}: ", "r12i0n8:11: "}, // torchrun's own example
		{"$hostname/$rank|", "r12i0n8/11|"},
		{"$$rank ${unknown} $unknown $", "$rank ${unknown} $unknown $"},
		{"${rank", "${rank"},
		{"${rank}${rank}x", "1111x"},
		{"$rankx", "$rankx"}, // Python reads the identifier "rankx"
		{"plain", "plain"},
	} {
		if got := expandTemplate(tc.in, vars); got != tc.want {
			t.Errorf("expandTemplate(%q) = %q, want %q", tc.in, got, tc.want)
		}
	}
}

// TestVirtualLocalRankEnv: every worker sees LOCAL_RANK=0 and its own GPU,
// mapped through the agent's CUDA_VISIBLE_DEVICES when it has one; the
// signals the agent handles are in TORCHELASTIC_SIGNALS_TO_HANDLE.
func TestVirtualLocalRankEnv(t *testing.T) {
	w := WorkerEnv{VirtualLocalRank: true, SignalsToHandle: "SIGTERM,SIGUSR1"}
	for _, tc := range []struct {
		base []string
		lr   int
		want string
	}{
		{nil, 2, "2"},
		{[]string{"CUDA_VISIBLE_DEVICES=4, 6,GPU-abc"}, 1, "6"},
		{[]string{"CUDA_VISIBLE_DEVICES=4,6,GPU-abc"}, 2, "GPU-abc"},
	} {
		env := lookup(w.Environ(tc.base, Assignment{LocalRank: tc.lr, Rank: 7}, "e.json"))
		if env["LOCAL_RANK"] != "0" || env["CUDA_VISIBLE_DEVICES"] != tc.want || env["RANK"] != "7" ||
			env["TORCHELASTIC_SIGNALS_TO_HANDLE"] != "SIGTERM,SIGUSR1" {
			t.Errorf("base %v, local rank %d: LOCAL_RANK=%s CUDA_VISIBLE_DEVICES=%s RANK=%s signals=%s; want 0, %s, 7",
				tc.base, tc.lr, env["LOCAL_RANK"], env["CUDA_VISIBLE_DEVICES"], env["RANK"], env["TORCHELASTIC_SIGNALS_TO_HANDLE"], tc.want)
		}
	}
	if err := checkVirtualDevices([]string{"CUDA_VISIBLE_DEVICES=0,1"}, 3); err == nil || !strings.Contains(err.Error(), "lists 2 GPU(s)") {
		t.Errorf("3 workers on 2 visible GPUs: %v", err)
	}
	if err := checkVirtualDevices(nil, 8); err != nil {
		t.Errorf("no CUDA_VISIBLE_DEVICES: %v", err)
	}
}

// TestPrefixTemplateAndDuplicateFilters: the console prefix follows
// --log-line-prefix-template, and the tee'd lines that match a filter are
// copied, prefixed, to the attempt's filtered logs.
func TestPrefixTemplateAndDuplicateFilters(t *testing.T) {
	cfg := shConfig(t, 2, `echo "apple $RANK"; echo "kiwi $RANK"; echo "orange, $RANK" >&2`)
	cfg.LogLinePrefixTemplate = "<${role_name}:${rank}:${local_rank}> "
	cfg.Tee = StdSpec{Default: StdAll}
	cfg.DuplicateStdoutFilters = []string{"apple", "banana"}
	cfg.DuplicateStderrFilters = []string{"orange,"}
	err, out, errs := runAgent(t, cfg, 30*time.Second)
	if err != nil {
		t.Fatalf("run: %v\n%s", err, errs)
	}
	for _, want := range []string{"<default:0:0> apple 0", "<default:1:1> kiwi 1"} {
		if !strings.Contains(out, want) {
			t.Errorf("console lacks %q:\n%s", want, out)
		}
	}
	files := func(name string) []string {
		matches, _ := filepath.Glob(filepath.Join(cfg.LogDir, "*", "attempt_0", name))
		if len(matches) != 1 {
			t.Fatalf("%s: %v", name, matches)
		}
		b, _ := os.ReadFile(matches[0])
		lines := strings.Split(strings.TrimSpace(string(b)), "\n")
		slices.Sort(lines)
		return lines
	}
	if got := files("filtered_stdout.log"); !slices.Equal(got, []string{"<default:0:0> apple 0", "<default:1:1> apple 1"}) {
		t.Errorf("filtered_stdout.log = %q", got)
	}
	if got := files("filtered_stderr.log"); !slices.Equal(got, []string{"<default:0:0> orange, 0", "<default:1:1> orange, 1"}) {
		t.Errorf("filtered_stderr.log = %q", got)
	}
}

// TestSparePrestartPrefixAndLogs: a pre-started worker's lines carry its
// rank in the prefix from its assignment on (lines the agent copied before
// it, "?"), and go to the attempt's logs and filtered logs as any
// worker's.
func TestSparePrestartPrefixAndLogs(t *testing.T) {
	cfg := shConfig(t, 2, `echo "early $LOCAL_RANK"; cat <&3 >/dev/null; echo "apple $LOCAL_RANK"`)
	cfg.SparePrestart = true
	cfg.LogLinePrefixTemplate = "<${rank}:${local_rank}> "
	cfg.Tee = StdSpec{Default: StdAll}
	cfg.DuplicateStdoutFilters = []string{"apple"}
	err, out, errs := runAgent(t, cfg, 30*time.Second)
	if err != nil {
		t.Fatalf("run: %v\n%s", err, errs)
	}
	for _, want := range []string{"<0:0> apple 0", "<1:1> apple 1"} {
		if !strings.Contains(out, want) {
			t.Errorf("console lacks %q:\n%s", want, out)
		}
	}
	// The assignment comes at once on one node: an early line may be
	// copied before it or after.
	for lr := range 2 {
		n := strconv.Itoa(lr)
		if !strings.Contains(out, "<?:"+n+"> early "+n) && !strings.Contains(out, "<"+n+":"+n+"> early "+n) {
			t.Errorf("console lacks local rank %d's early line:\n%s", lr, out)
		}
	}
	matches, _ := filepath.Glob(filepath.Join(cfg.LogDir, "*", "attempt_0", "filtered_stdout.log"))
	if len(matches) != 1 {
		t.Fatalf("filtered_stdout.log: %v", matches)
	}
	b, _ := os.ReadFile(matches[0])
	lines := strings.Split(strings.TrimSpace(string(b)), "\n")
	slices.Sort(lines)
	if !slices.Equal(lines, []string{"<0:0> apple 0", "<1:1> apple 1"}) {
		t.Errorf("filtered_stdout.log = %q", lines)
	}
	logs, _ := filepath.Glob(filepath.Join(cfg.LogDir, "*", "attempt_0", "1", "stdout.log"))
	if len(logs) != 1 {
		t.Fatalf("stdout.log of local rank 1: %v", logs)
	}
	if b, _ := os.ReadFile(logs[0]); string(b) != "early 1\napple 1\n" {
		t.Errorf("stdout.log of local rank 1 = %q", b)
	}
}
