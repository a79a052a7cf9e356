package launcher

import (
	"errors"
	"os"
	"path/filepath"
	"reflect"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
)

// wantInvalid fails unless err matches ErrInvalidConfig and its text
// mentions every hint (case-insensitive).
func wantInvalid(t *testing.T, what string, err error, hints ...string) {
	t.Helper()
	if err == nil {
		t.Fatalf("%s: accepted, want an error mentioning %q", what, hints)
	}
	if !errors.Is(err, ErrInvalidConfig) {
		t.Fatalf("%s: error %q does not match ErrInvalidConfig", what, err)
	}
	for _, h := range hints {
		if !strings.Contains(strings.ToLower(err.Error()), strings.ToLower(h)) {
			t.Fatalf("%s: error %q does not mention %q", what, err, h)
		}
	}
	if strings.Contains(err.Error(), "\n") {
		t.Fatalf("%s: error %q spans lines", what, err)
	}
}

func TestParseStd(t *testing.T) {
	good := []struct {
		in   string
		want StdSpec
	}{
		{"", StdSpec{}},
		{"0", StdSpec{Default: StdNone}},
		{"1", StdSpec{Default: StdOut}},
		{"2", StdSpec{Default: StdErr}},
		{" 3 ", StdSpec{Default: StdAll}},
		{"0:1,1:2", StdSpec{PerRank: map[int]Std{0: StdOut, 1: StdErr}}},
		{"0:3", StdSpec{PerRank: map[int]Std{0: StdAll}}},
		{"12:1, 3:0", StdSpec{PerRank: map[int]Std{12: StdOut, 3: StdNone}}},
		{"0:1,0:2", StdSpec{PerRank: map[int]Std{0: StdErr}}}, // last wins, as in torchrun
	}
	for _, tc := range good {
		got, err := ParseStd(tc.in)
		if err != nil || !reflect.DeepEqual(got, tc.want) {
			t.Errorf("ParseStd(%q) = %+v, %v; want %+v", tc.in, got, err, tc.want)
		}
	}
	bad := []struct{ in, hint string }{
		{"7", `"7"`},
		{"4", `"4"`},
		{"-1", `"-1"`},
		{"all", `"all"`},
		{"0:1,1", `"1" is not LOCAL_RANK:STD`},
		{"0:1,x:2", `local rank "x"`},
		{"-1:2", `local rank "-1"`},
		{"0:9", `"9"`},
		{"0:", `""`},
		{"0:1,,1:2", `"" is not LOCAL_RANK:STD`},
	}
	for _, tc := range bad {
		_, err := ParseStd(tc.in)
		wantInvalid(t, "ParseStd("+tc.in+")", err, tc.hint)
	}
}

func TestStdSpecFor(t *testing.T) {
	all := StdSpec{Default: StdAll}
	per := StdSpec{PerRank: map[int]Std{0: StdOut, 2: StdErr}}
	cases := []struct {
		spec StdSpec
		rank int
		want Std
	}{
		{StdSpec{}, 0, StdNone},
		{all, 0, StdAll},
		{all, 7, StdAll},
		{per, 0, StdOut},
		{per, 1, StdNone}, // not named: none, as torchrun's to_map
		{per, 2, StdErr},
		{per, 9, StdNone},
	}
	for _, tc := range cases {
		if got := tc.spec.For(tc.rank); got != tc.want {
			t.Errorf("%+v.For(%d) = %d, want %d", tc.spec, tc.rank, got, tc.want)
		}
	}
}

func TestEntrypointArgv(t *testing.T) {
	args := []string{"--lr", "0.1", "-m", "x"}
	cases := []struct {
		name string
		e    Entrypoint
		want []string
	}{
		{"script", Entrypoint{Program: "train.py", Args: args, Python: "python3"},
			[]string{"python3", "-u", "train.py", "--lr", "0.1", "-m", "x"}},
		{"module", Entrypoint{Program: "pkg.train", Module: true, Python: "/opt/py/bin/python"},
			[]string{"/opt/py/bin/python", "-u", "-m", "pkg.train"}},
		{"no python", Entrypoint{Program: "./worker", Args: args, NoPython: true, Python: "python3"},
			[]string{"./worker", "--lr", "0.1", "-m", "x"}},
		{"run path", Entrypoint{Program: "/abs/train.py", RunPath: true, Python: "python3"},
			[]string{"python3", "-u", "/abs/train.py"}},
		{"run path wins over no python", Entrypoint{Program: "/abs/train.py", RunPath: true, NoPython: true},
			[]string{"python3", "-u", "/abs/train.py"}},
		{"empty interpreter is python3", Entrypoint{Program: "train.py"},
			[]string{"python3", "-u", "train.py"}},
	}
	for _, tc := range cases {
		if got := tc.e.Argv(); !reflect.DeepEqual(got, tc.want) {
			t.Errorf("%s: Argv() = %q, want %q", tc.name, got, tc.want)
		}
	}
	// Argv must not alias Args: the agent may append per worker.
	e := Entrypoint{Program: "w", NoPython: true, Args: make([]string, 1, 8)}
	argv := e.Argv()
	argv[1] = "changed"
	if e.Args[0] != "" {
		t.Fatal("Argv shares its backing array with Args")
	}
}

func TestParseRdzvConf(t *testing.T) {
	good := []struct {
		in   string
		want map[string]string
	}{
		{"", map[string]string{}},
		{"  ", map[string]string{}},
		{"join_timeout=900", map[string]string{"join_timeout": "900"}},
		{"a=1, b = 2 ,c=host:29400", map[string]string{"a": "1", "b": "2", "c": "host:29400"}},
		{"k=x=y", map[string]string{"k": "x=y"}},
		{"k=1,k=2", map[string]string{"k": "2"}},
	}
	for _, tc := range good {
		got, err := ParseRdzvConf(tc.in)
		if err != nil || !reflect.DeepEqual(got, tc.want) {
			t.Errorf("ParseRdzvConf(%q) = %v, %v; want %v", tc.in, got, err, tc.want)
		}
	}
	bad := []struct{ in, hint string }{
		{"x", `"x" has no value`},
		{"k=", `"k" has no value`},
		{"=v", `"=v" has no key`},
		{"a=1,,b=2", `"" has no key`},
		{"a=1,b", `"b" has no value`},
	}
	for _, tc := range bad {
		_, err := ParseRdzvConf(tc.in)
		wantInvalid(t, "ParseRdzvConf("+tc.in+")", err, tc.hint)
	}
}

func TestParseNNodes(t *testing.T) {
	good := []struct {
		in       string
		min, max int
	}{
		{"1", 1, 1}, {"2", 2, 2}, {"1:4", 1, 4}, {"3:3", 3, 3}, {" 2 : 8 ", 2, 8},
	}
	for _, tc := range good {
		lo, hi, err := ParseNNodes(tc.in)
		if err != nil || lo != tc.min || hi != tc.max {
			t.Errorf("ParseNNodes(%q) = %d, %d, %v; want %d, %d", tc.in, lo, hi, err, tc.min, tc.max)
		}
	}
	bad := []struct{ in, hint string }{
		{"0", "at least 1 node"},
		{"0:2", "at least 1 node"},
		{"-1", "at least 1 node"},
		{"3:2", "maximum 2 is below the minimum 3"},
		{"", `"" is not an integer`},
		{"two", `"two" is not an integer`},
		{"1:", `"" is not an integer`},
		{"1:2:3", `"2:3" is not an integer`},
		{"1.5", `"1.5"`},
	}
	for _, tc := range bad {
		_, _, err := ParseNNodes(tc.in)
		wantInvalid(t, "ParseNNodes("+tc.in+")", err, tc.in, tc.hint)
	}
}

func TestParseSignals(t *testing.T) {
	def := []syscall.Signal{syscall.SIGTERM, syscall.SIGINT, syscall.SIGHUP, syscall.SIGQUIT}
	good := []struct {
		in   string
		want []syscall.Signal
	}{
		{"SIGTERM,SIGINT,SIGHUP,SIGQUIT", def},
		{"SIGTERM,SIGUSR1,SIGUSR2", []syscall.Signal{syscall.SIGTERM, syscall.SIGUSR1, syscall.SIGUSR2}},
		{"term, usr1 ,SigHup", []syscall.Signal{syscall.SIGTERM, syscall.SIGUSR1, syscall.SIGHUP}},
		{"15,10", []syscall.Signal{syscall.SIGTERM, syscall.SIGUSR1}},
		{"SIGTERM,TERM,15", []syscall.Signal{syscall.SIGTERM}},
		{"SIGIOT,SIGPOLL", []syscall.Signal{syscall.SIGABRT, syscall.SIGIO}},
		{"", nil},
	}
	for _, tc := range good {
		got, err := ParseSignals(tc.in)
		if err != nil || !reflect.DeepEqual(got, tc.want) {
			t.Errorf("ParseSignals(%q) = %v, %v; want %v", tc.in, got, err, tc.want)
		}
	}
	bad := []struct{ in, hint string }{
		{"SIGFOO", `unknown signal "SIGFOO"`},
		{"SIGTERM,bogus", `unknown signal "bogus"`},
		{"SIGTERM,", `unknown signal ""`},
		{"SIGKILL", "SIGKILL cannot be caught"},
		{"stop", "SIGSTOP cannot be caught"},
		{"9", "SIGKILL cannot be caught"},
		{"SIGCHLD", "SIGCHLD"},
		{"SIGURG", "Go runtime"},
		{"0", `"0" is not a signal number`},
		{"65", `"65" is not a signal number`},
	}
	for _, tc := range bad {
		_, err := ParseSignals(tc.in)
		wantInvalid(t, "ParseSignals("+tc.in+")", err, tc.hint)
	}
}

// fakeDev makes a directory with the named (empty) files, standing in for
// /dev: the GPU count only looks at names.
func fakeDev(t *testing.T, names ...string) string {
	t.Helper()
	dir := t.TempDir()
	for _, n := range names {
		if err := os.WriteFile(filepath.Join(dir, n), nil, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	return dir
}

func TestCountGPUs(t *testing.T) {
	noise := []string{"nvidiactl", "nvidia-uvm", "nvidia-uvm-tools", "nvidia-modeset", "nvidiaX", "null", "tty0"}
	cases := []struct {
		names []string
		want  int
	}{
		{nil, 0},
		{noise, 0},
		{append([]string{"nvidia0"}, noise...), 1},
		{append([]string{"nvidia0", "nvidia1", "nvidia2", "nvidia3", "nvidia10"}, noise...), 5},
	}
	for _, tc := range cases {
		if got, err := countGPUs(fakeDev(t, tc.names...)); err != nil || got != tc.want {
			t.Errorf("countGPUs(%q) = %d, %v; want %d", tc.names, got, err, tc.want)
		}
	}
	if got, err := countGPUs(filepath.Join(t.TempDir(), "missing")); err != nil || got != 0 {
		t.Errorf("countGPUs(missing dir) = %d, %v; want 0, nil", got, err)
	}
}

func TestVisibleGPUs(t *testing.T) {
	four := fakeDev(t, "nvidia0", "nvidia1", "nvidia2", "nvidia3", "nvidiactl")
	cases := []struct {
		visible string
		set     bool
		want    int
	}{
		{"", false, 4},
		{"", true, 0},
		{"0,1", true, 2},
		{"3", true, 1},
		{"1,0,3,2", true, 4},
		{"0,1,7,2", true, 2}, // stops at the first index out of range
		{"-1", true, 0},
		{"0,-1,1", true, 1},
		{"GPU-3f2a,GPU-77aa", true, 2},
		{"MIG-1,MIG-2,MIG-3,MIG-4,MIG-5", true, 4}, // never more than the devices
		{"0,bogus,1", true, 1},
	}
	for _, tc := range cases {
		if got, err := visibleGPUs(four, tc.visible, tc.set); err != nil || got != tc.want {
			t.Errorf("visibleGPUs(CUDA_VISIBLE_DEVICES=%q set=%v) = %d, %v; want %d", tc.visible, tc.set, got, err, tc.want)
		}
	}
	if got, _ := visibleGPUs(fakeDev(t), "0,1", true); got != 0 {
		t.Errorf("no devices but CUDA_VISIBLE_DEVICES=0,1: got %d GPUs, want 0", got)
	}
}

func TestResolveNProc(t *testing.T) {
	const cpus = 12
	gpuDirs := map[string]string{
		"none": fakeDev(t, "nvidiactl", "null"),
		"two":  fakeDev(t, "nvidia0", "nvidia1", "nvidiactl"),
	}
	good := []struct {
		in, dev string
		want    int
	}{
		{"1", "none", 1},
		{"8", "two", 8},
		{" 4 ", "none", 4},
		{"cpu", "two", cpus},
		{"gpu", "two", 2},
		{"auto", "two", 2},
		{"auto", "none", cpus}, // torchrun: no accelerator → os.cpu_count()
	}
	for _, tc := range good {
		dir := gpuDirs[tc.dev]
		got, err := resolveNProc(tc.in, func() (int, error) { return visibleGPUs(dir, "", false) }, cpus)
		if err != nil || got != tc.want {
			t.Errorf("resolveNProc(%q, %s GPUs) = %d, %v; want %d", tc.in, tc.dev, got, err, tc.want)
		}
	}
	bad := []struct{ in, dev, hint string }{
		{"0", "two", "at least 1 worker"},
		{"-2", "two", "at least 1 worker"},
		{"gpu", "none", "no NVIDIA GPU"},
		{"xpu", "two", `"xpu" is not a worker count`},
		{"", "two", `"" is not a worker count`},
		{"zero", "two", "auto, cpu or gpu"},
	}
	for _, tc := range bad {
		dir := gpuDirs[tc.dev]
		_, err := resolveNProc(tc.in, func() (int, error) { return visibleGPUs(dir, "", false) }, cpus)
		wantInvalid(t, "resolveNProc("+tc.in+")", err, tc.hint)
	}
	// An unreadable device directory is reported, not taken for "no GPU".
	_, err := resolveNProc("gpu", func() (int, error) { return 0, errors.New("permission denied") }, cpus)
	wantInvalid(t, "resolveNProc(gpu, unreadable)", err, "permission denied")

	// The exported form: integers and cpu need no devices.
	if n, err := ResolveNProc("3"); err != nil || n != 3 {
		t.Errorf("ResolveNProc(3) = %d, %v", n, err)
	}
	if n, err := ResolveNProc("cpu"); err != nil || n < 1 {
		t.Errorf("ResolveNProc(cpu) = %d, %v", n, err)
	}
}

// TestResolveNProcOnThisMachine checks the real /dev against a count the
// caller knows (e.g. from nvidia-smi on a GPU machine):
// GORUN_TEST_EXPECT_GPUS=N go test -run TestResolveNProcOnThisMachine.
func TestResolveNProcOnThisMachine(t *testing.T) {
	want := os.Getenv("GORUN_TEST_EXPECT_GPUS")
	if want == "" {
		t.Skip("GORUN_TEST_EXPECT_GPUS not set")
	}
	got, err := ResolveNProc("auto")
	if _, gpuErr := ResolveNProc("gpu"); want == "0" && gpuErr == nil {
		t.Errorf("ResolveNProc(gpu) found GPUs; want none")
	}
	if want != "0" && (err != nil || want != strconv.Itoa(got)) {
		t.Fatalf("ResolveNProc(auto) = %d, %v; want %s GPUs", got, err, want)
	}
	t.Logf("auto → %d workers", got)
}

func TestDefaultConfig(t *testing.T) {
	c := DefaultConfig()
	checks := []struct {
		field     string
		got, want any
	}{
		{"MinNodes", c.MinNodes, 1},
		{"MaxNodes", c.MaxNodes, 1},
		{"NProcPerNode", c.NProcPerNode, 1},
		{"Role", c.Role, "default"},
		{"Backend", c.Rendezvous.Backend, "static"},
		{"Endpoint", c.Rendezvous.Endpoint, ""},
		{"RunID", c.Rendezvous.RunID, "none"},
		{"Conf", c.Rendezvous.Conf, map[string]string{}},
		{"MasterAddr", c.Rendezvous.MasterAddr, "127.0.0.1"},
		{"MasterPort", c.Rendezvous.MasterPort, 29500},
		{"NodeRank", c.Rendezvous.NodeRank, 0},
		{"MaxRestarts", c.MaxRestarts, 0},
		{"MonitorInterval", c.MonitorInterval, 100 * time.Millisecond},
		{"StartMethod", c.StartMethod, "spawn"},
		{"LogDir", c.LogDir, ""},
		{"Redirects", c.Redirects, StdSpec{}},
		{"Tee", c.Tee, StdSpec{}},
		{"LocalRanksFilter", c.LocalRanksFilter, []int(nil)},
		{"SignalsToHandle", c.SignalsToHandle,
			[]syscall.Signal{syscall.SIGTERM, syscall.SIGINT, syscall.SIGHUP, syscall.SIGQUIT}},
		{"ShutdownTimeout", c.ShutdownTimeout, 30 * time.Second},
		{"ExitBarrierTimeout", c.ExitBarrierTimeout, 300 * time.Second},
		{"Python", c.Entrypoint.Python, "python3"},
		{"Init", c.Init, false},
		{"HealthAddr", c.HealthAddr, ""},
		{"Regrow", c.Regrow, true},
		{"MaxRespawns", c.MaxRespawns, 3},
		{"RespawnBackoff", c.RespawnBackoff, time.Second},
		{"GrowTimeout", c.GrowTimeout, 30 * time.Second},
	}
	for _, ch := range checks {
		if !reflect.DeepEqual(ch.got, ch.want) {
			t.Errorf("DefaultConfig().%s = %v, want %v", ch.field, ch.got, ch.want)
		}
	}
	// The defaults plus a program are a valid configuration.
	c.Entrypoint.Program = "train.py"
	if err := c.Validate(); err != nil {
		t.Fatalf("defaults with a program: %v", err)
	}
}

func TestValidate(t *testing.T) {
	base := func() Config {
		c := DefaultConfig()
		c.Entrypoint.Program = "train.py"
		return c
	}
	good := []struct {
		name string
		mod  func(*Config)
	}{
		{"defaults", func(*Config) {}},
		{"static two nodes, rank 1", func(c *Config) { c.MinNodes, c.MaxNodes, c.Rendezvous.NodeRank = 2, 2, 1 }},
		{"static endpoint with port", func(c *Config) { c.Rendezvous.Endpoint = "node0:29600" }},
		{"static ipv6 master", func(c *Config) { c.Rendezvous.MasterAddr = "[::1]" }},
		{"single node port 0", func(c *Config) { c.Rendezvous.MasterPort = 0 }},
		{"c10d elastic", func(c *Config) {
			c.MinNodes, c.MaxNodes = 1, 4
			c.Rendezvous.Backend, c.Rendezvous.Endpoint, c.Rendezvous.RunID = "c10d", "node0:29400", "job1"
		}},
		{"c10d no endpoint", func(c *Config) { c.Rendezvous.Backend = "c10d" }},
		{"c10d endpoint without port", func(c *Config) { c.Rendezvous.Backend, c.Rendezvous.Endpoint = "c10d", "node0" }},
		{"c10d ipv6 endpoint", func(c *Config) { c.Rendezvous.Backend, c.Rendezvous.Endpoint = "c10d", "[fe80::1%eth0]:29400" }},
		{"c10d file store", func(c *Config) {
			c.Rendezvous.Backend, c.Rendezvous.Endpoint = "c10d", "/shared/rdzv file"
			c.Rendezvous.Conf = map[string]string{"store_type": "FILE"}
		}},
		{"c10d conf", func(c *Config) {
			c.Rendezvous.Backend = "c10d"
			c.Rendezvous.Conf = map[string]string{"join_timeout": "900", "last_call_timeout": "0.5",
				"keep_alive_max_attempt": "3", "is_host": "yes", "use_libuv": "0", "custom_key": "kept"}
		}},
		{"etcd-v2", func(c *Config) { c.Rendezvous.Backend, c.Rendezvous.Endpoint = "etcd-v2", "etcd:2379" }},
		{"etcd", func(c *Config) { c.Rendezvous.Backend = "etcd" }},
		{"standalone ignores rdzv values", func(c *Config) {
			c.Rendezvous.Standalone, c.Rendezvous.Backend, c.Rendezvous.RunID = true, "bogus", ""
		}},
		{"module", func(c *Config) { c.Entrypoint.Module = true }},
		{"run path with no python", func(c *Config) { c.Entrypoint.RunPath, c.Entrypoint.NoPython, c.Entrypoint.Module = true, true, true }},
		{"redirects per rank", func(c *Config) { c.Redirects = StdSpec{PerRank: map[int]Std{0: StdAll, 5: StdOut}} }},
		{"filter", func(c *Config) { c.LocalRanksFilter = []int{0, 3} }},
		{"no signals", func(c *Config) { c.SignalsToHandle = nil }},
		{"kill at once", func(c *Config) { c.ShutdownTimeout = 0 }},
		{"restarts", func(c *Config) { c.MaxRestarts = 3 }},
		{"heal off, no respawns, at once", func(c *Config) { c.Regrow, c.MaxRespawns, c.RespawnBackoff = false, 0, 0 }},
		{"heal with standbys", func(c *Config) { c.OnFailure, c.RespawnStandbys = OnFailureShrink, 2 }},
		{"start method fork", func(c *Config) { c.StartMethod = "fork" }},
		{"local addr", func(c *Config) { c.Rendezvous.LocalAddr = "10.0.0.7" }},
		{"local addr ipv6", func(c *Config) { c.Rendezvous.LocalAddr = "[fd00::7]" }},
		{"health every interface", func(c *Config) { c.HealthAddr = ":8080" }},
		{"health loopback", func(c *Config) { c.HealthAddr = "127.0.0.1:9100" }},
		{"health host name", func(c *Config) { c.HealthAddr = "node0.example.com:8080" }},
		{"health ipv6", func(c *Config) { c.HealthAddr = "[::1]:8080" }},
		{"health free port", func(c *Config) { c.HealthAddr = "127.0.0.1:0" }},
		{"health highest port", func(c *Config) { c.HealthAddr = ":65535" }},
	}
	for _, tc := range good {
		c := base()
		tc.mod(&c)
		if err := c.Validate(); err != nil {
			t.Errorf("%s: %v", tc.name, err)
		}
	}

	bad := []struct {
		name string
		mod  func(*Config)
		hint string
	}{
		{"no program", func(c *Config) { c.Entrypoint.Program = "" }, "no program"},
		{"no-python with module", func(c *Config) { c.Entrypoint.NoPython, c.Entrypoint.Module = true, true }, "--no-python and --module"},
		{"zero nodes", func(c *Config) { c.MinNodes = 0 }, "--nnodes 0:1"},
		{"max below min", func(c *Config) { c.MinNodes, c.MaxNodes = 3, 2 }, "--nnodes 3:2"},
		{"zero workers", func(c *Config) { c.NProcPerNode = 0 }, "--nproc-per-node 0"},
		{"empty role", func(c *Config) { c.Role = "" }, "--role"},
		{"unknown backend", func(c *Config) { c.Rendezvous.Backend = "zookeeper" }, `--rdzv-backend "zookeeper"`},
		{"empty run id", func(c *Config) { c.Rendezvous.RunID = "" }, "--rdzv-id"},
		{"static elastic", func(c *Config) { c.MinNodes, c.MaxNodes = 1, 4 }, "static rendezvous is not elastic"},
		{"standalone with several nodes", func(c *Config) {
			c.Rendezvous.Standalone = true
			c.MinNodes, c.MaxNodes = 1, 2
		}, "--standalone runs one node"},
		{"static rank too high", func(c *Config) { c.MinNodes, c.MaxNodes, c.Rendezvous.NodeRank = 2, 2, 2 }, "--node-rank 2"},
		{"static negative rank", func(c *Config) { c.Rendezvous.NodeRank = -1 }, "--node-rank -1"},
		{"static port too high", func(c *Config) { c.Rendezvous.MasterPort = 70000 }, "--master-port 70000"},
		{"static negative port", func(c *Config) { c.Rendezvous.MasterPort = -1 }, "--master-port -1"},
		{"static port 0 multi-node", func(c *Config) {
			c.MinNodes, c.MaxNodes, c.Rendezvous.MasterPort = 2, 2, 0
		}, "--master-port 0"},
		{"static no master addr", func(c *Config) { c.Rendezvous.MasterAddr = "" }, "--master-addr"},
		{"static bad master addr", func(c *Config) { c.Rendezvous.MasterAddr = "a b" }, `--master-addr "a b"`},
		{"static endpoint without port", func(c *Config) { c.Rendezvous.Endpoint = "node0" }, "HOST:PORT"},
		{"c10d bad port", func(c *Config) { c.Rendezvous.Backend, c.Rendezvous.Endpoint = "c10d", "node0:99999" }, `port "99999"`},
		{"c10d bad host", func(c *Config) { c.Rendezvous.Backend, c.Rendezvous.Endpoint = "c10d", "no/de:1" }, `"no/de"`},
		{"c10d port not a number", func(c *Config) { c.Rendezvous.Backend, c.Rendezvous.Endpoint = "c10d", "node0:http" }, `port "http"`},
		{"conf join_timeout", func(c *Config) { c.Rendezvous.Conf = map[string]string{"join_timeout": "soon"} }, "join_timeout=soon"},
		{"conf zero timeout", func(c *Config) { c.Rendezvous.Conf = map[string]string{"read_timeout": "0"} }, "read_timeout=0"},
		{"conf attempts", func(c *Config) { c.Rendezvous.Conf = map[string]string{"keep_alive_max_attempt": "0"} }, "keep_alive_max_attempt=0"},
		{"conf is_host", func(c *Config) { c.Rendezvous.Conf = map[string]string{"is_host": "maybe"} }, "is_host=maybe"},
		{"conf store_type", func(c *Config) { c.Rendezvous.Conf = map[string]string{"store_type": "redis"} }, "store_type=redis"},
		{"bad local addr", func(c *Config) { c.Rendezvous.LocalAddr = "x y" }, "--local-addr"},
		{"negative restarts", func(c *Config) { c.MaxRestarts = -1 }, "--max-restarts -1"},
		{"negative respawns", func(c *Config) { c.MaxRespawns = -1 }, "--max-respawns -1"},
		{"negative respawn backoff", func(c *Config) { c.RespawnBackoff = -time.Second }, "--respawn-backoff"},
		{"negative standbys", func(c *Config) { c.OnFailure, c.RespawnStandbys = OnFailureShrink, -1 }, "--respawn-standbys -1"},
		{"standbys in restart mode", func(c *Config) { c.RespawnStandbys = 1 }, "needs --on-failure shrink with --regrow on"},
		{"standbys with heal off", func(c *Config) { c.OnFailure, c.Regrow, c.RespawnStandbys = OnFailureShrink, false, 1 }, "needs --on-failure shrink"},
		{"standbys with numa binding", func(c *Config) { c.OnFailure, c.RespawnStandbys, c.NUMABinding = OnFailureShrink, 1, "node" }, "--numa-binding node"},
		{"zero grow timeout", func(c *Config) { c.GrowTimeout = 0 }, "--grow-timeout"},
		{"zero monitor interval", func(c *Config) { c.MonitorInterval = 0 }, "--monitor-interval"},
		{"start method", func(c *Config) { c.StartMethod = "thread" }, `--start-method "thread"`},
		{"negative shutdown", func(c *Config) { c.ShutdownTimeout = -time.Second }, "--shutdown-timeout"},
		{"zero exit barrier", func(c *Config) { c.ExitBarrierTimeout = 0 }, "--exit-barrier-timeout"},
		{"SIGKILL", func(c *Config) { c.SignalsToHandle = []syscall.Signal{syscall.SIGKILL} }, "SIGKILL"},
		{"signal 0", func(c *Config) { c.SignalsToHandle = []syscall.Signal{0} }, "--signals-to-handle"},
		{"redirects 7", func(c *Config) { c.Redirects = StdSpec{Default: 7} }, "--redirects"},
		{"tee rank value 5", func(c *Config) { c.Tee = StdSpec{PerRank: map[int]Std{1: 5}} }, "--tee"},
		{"negative filter", func(c *Config) { c.LocalRanksFilter = []int{-1} }, "--local-ranks-filter"},
		{"health no port", func(c *Config) { c.HealthAddr = "8080" }, `--health-addr "8080" is not HOST:PORT`},
		{"health host only", func(c *Config) { c.HealthAddr = "localhost" }, "--health-addr"},
		{"health empty port", func(c *Config) { c.HealthAddr = "127.0.0.1:" }, `port ""`},
		{"health port too high", func(c *Config) { c.HealthAddr = ":65536" }, `port "65536"`},
		{"health negative port", func(c *Config) { c.HealthAddr = ":-1" }, `port "-1"`},
		{"health signed port", func(c *Config) { c.HealthAddr = ":+80" }, `port "+80"`},
		{"health service name", func(c *Config) { c.HealthAddr = ":http" }, `port "http"`},
		{"health bad host", func(c *Config) { c.HealthAddr = "a b:8080" }, `"a b" is not a host name`},
		{"health bare ipv6", func(c *Config) { c.HealthAddr = "::1:8080" }, "--health-addr"},
		{"health url", func(c *Config) { c.HealthAddr = "http://0.0.0.0:8080" }, "--health-addr"},
		{"node liveness mode", func(c *Config) { c.NodeLiveness.Mode = "sometimes" }, `--node-liveness "sometimes"`},
	}
	for _, tc := range bad {
		c := base()
		tc.mod(&c)
		wantInvalid(t, tc.name, c.Validate(), tc.hint)
	}
}

// TestRendezvousSettings: Validate parses the rendezvous flags and
// --rdzv-conf once into the settings the memberships run with.
func TestRendezvousSettings(t *testing.T) {
	cases := []struct {
		name    string
		mod     func(*Config)
		want    func(rendezvousSettings) bool
		explain string
	}{
		{"c10d defaults", func(c *Config) {},
			func(s rendezvousSettings) bool {
				return s.host == "node0" && s.port == defaultC10dPort && s.readTimeout == defaultReadTimeout &&
					!s.isHostGiven && !s.fileStore && s.dynamic.MinNodes == 2 && s.dynamic.MaxNodes == 3 && s.dynamic.RunID == "job"
			}, "node0:29400, read_timeout 60 s, no is_host, dynamic 2..3"},
		{"c10d conf", func(c *Config) {
			c.Rendezvous.Endpoint = "[::1]:1234"
			c.Rendezvous.Conf = map[string]string{"read_timeout": "2.5", "is_host": "no", "join_timeout": "7"}
		}, func(s rendezvousSettings) bool {
			return s.host == "::1" && s.port == 1234 && s.readTimeout == 2500*time.Millisecond &&
				s.isHostGiven && !s.isHost && s.dynamic.JoinTimeout == 7*time.Second
		}, "[::1]:1234, read 2.5 s, is_host given false, join 7 s"},
		{"file store", func(c *Config) { c.Rendezvous.Conf = map[string]string{"store_type": "FILE"} },
			func(s rendezvousSettings) bool { return s.fileStore }, "a FileStore"},
		{"static rank 0 hosts", func(c *Config) {
			c.Rendezvous.Backend, c.MinNodes, c.MaxNodes, c.Rendezvous.Endpoint = backendStatic, 2, 2, ""
		}, func(s rendezvousSettings) bool {
			return s.host == defaultMasterAddr && s.port == defaultMasterPort && s.isHost && !s.isHostGiven
		}, "the master address, rank 0 hosting"},
		{"static rank 1 does not", func(c *Config) {
			c.Rendezvous.Backend, c.MinNodes, c.MaxNodes, c.Rendezvous.NodeRank = backendStatic, 2, 2, 1
			c.Rendezvous.Endpoint = "node0:29500"
		}, func(s rendezvousSettings) bool { return s.host == "node0" && s.port == 29500 && !s.isHost },
			"node0:29500, not hosting"},
	}
	for _, tc := range cases {
		c := DefaultConfig()
		c.Entrypoint.Program = "x"
		c.MinNodes, c.MaxNodes = 2, 3
		c.Rendezvous.Backend, c.Rendezvous.Endpoint, c.Rendezvous.RunID = backendC10d, "node0", "job"
		tc.mod(&c)
		if err := c.Validate(); err != nil {
			t.Fatalf("%s: %v", tc.name, err)
		}
		if !tc.want(c.rdzv) {
			t.Errorf("%s: settings %+v, want %s", tc.name, c.rdzv, tc.explain)
		}
	}
}

func TestSplitEndpoint(t *testing.T) {
	cases := []struct {
		in   string
		host string
		port int
	}{
		{"", "localhost", 29400},
		{"node0", "node0", 29400},
		{"node0:1234", "node0", 1234},
		{" 10.0.0.1:0 ", "10.0.0.1", 0},
		{"[::1]", "::1", 29400},
		{"[::1]:5", "::1", 5},
		{"fe80::1", "fe80::1", 29400},
		{"::1", "::1", 29400},
		{"::1:29622", "::1", 29622}, // torchrun's reading
		{"fe80::1%eth0:7", "fe80::1%eth0", 7},
	}
	for _, tc := range cases {
		h, p, err := splitEndpoint(tc.in, 29400)
		if err != nil || h != tc.host || p != tc.port {
			t.Errorf("splitEndpoint(%q) = %q, %d, %v; want %q, %d", tc.in, h, p, err, tc.host, tc.port)
		}
	}
	for _, bad := range []string{"node0:", ":29400", "node0:65536", "node0:-1", "[::1", "a b:1", "node0:012345", "[::1]:x", "x::y:1"} {
		if _, _, err := splitEndpoint(bad, 29400); err == nil {
			t.Errorf("splitEndpoint(%q) accepted", bad)
		}
	}
}

// TestNodeLivenessRuns: gossip runs on several nodes only; by default in
// shrink mode only, where a lost node's ranks are reported at once; on
// and off force it.
func TestNodeLivenessRuns(t *testing.T) {
	tests := []struct {
		mode      string
		maxNodes  int
		onFailure string
		want      bool
	}{
		{NodeLivenessAuto, 2, OnFailureShrink, true},
		{NodeLivenessAuto, 2, OnFailureRestart, false},
		{"", 2, OnFailureShrink, true},
		{NodeLivenessAuto, 1, OnFailureShrink, false},
		{NodeLivenessOn, 2, OnFailureRestart, true},
		{NodeLivenessOn, 1, OnFailureRestart, false},
		{NodeLivenessOff, 2, OnFailureShrink, false},
	}
	for _, tt := range tests {
		c := NodeLivenessConfig{Mode: tt.mode}
		if got := c.runs(tt.maxNodes, tt.onFailure); got != tt.want {
			t.Errorf("mode %q, %d nodes, %s: runs %v, want %v", tt.mode, tt.maxNodes, tt.onFailure, got, tt.want)
		}
	}
}

func TestSameSecret(t *testing.T) {
	a, b := Secret("s3cr3t-aaaaaaaaaaaaaa").check("job"), Secret("s3cr3t-bbbbbbbbbbbbbb").check("job")
	if a == b || a == "" || a != Secret("s3cr3t-aaaaaaaaaaaaaa").check("job") || a == Secret("s3cr3t-aaaaaaaaaaaaaa").check("job2") {
		t.Fatalf("checks: %q %q: want equal for one secret and run, different otherwise", a, b)
	}
	if strings.Contains(a, "s3cr3t") || Secret(nil).check("job") != "" {
		t.Fatalf("check %q shows the secret, or none has a check", a)
	}
	ids := []string{"n0", "n1", "n2"}
	for _, tc := range []struct {
		name   string
		checks []string
		me     int
		want   string // in the error; "" for none
	}{
		{"all the same", []string{a, a, a}, 1, ""},
		{"none anywhere", []string{"", "", ""}, 0, ""},
		{"another", []string{a, b, a}, 0, "node n1 (n1.example) holds another job secret than this node"},
		{"one without", []string{a, a, ""}, 0, "node n2 (n2.example) holds no job secret, and this node one"},
		{"this node without", []string{a, "", a}, 1, "node n0 (n0.example) holds a job secret and this node none"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			infos := make([]nodeInfo, len(tc.checks))
			for i, c := range tc.checks {
				infos[i] = nodeInfo{Addr: ids[i] + ".example", SecretCheck: c}
			}
			err := sameSecret(infos, ids, tc.me)
			switch {
			case tc.want == "" && err != nil:
				t.Fatalf("error %v, want none", err)
			case tc.want != "" && (err == nil || !strings.Contains(err.Error(), tc.want) || !errors.Is(err, ErrInvalidConfig)):
				t.Fatalf("error %v, want ErrInvalidConfig saying %q", err, tc.want)
			}
		})
	}
}
