// Package sidbed is the Debian sid test bed: a chroot with today's PyTorch
// (Debian's python3-torch, 2.14) and NCCL (contrib's libnccl2 and
// libnccl-dev, 2.29), so that gorun's tests run against them as real peers,
// next to Debian 12's PyTorch 1.13 on the host.
//
// Build makes the chroot once with debootstrap, from the Debian mirror the
// host's apt uses, and caches it at a stable path (DefaultDir) with a stamp
// recording what was installed; `make test-deps` runs it (go run
// ./internal/sidbed/cmd/sidbed build). Find and Require only read the
// stamp: they never build. Measured on a 2-core machine shared with other
// work: a cold build took 249 s and 244 s (debootstrap about 110 s, apt the
// rest; 1.9 GB); a warm check is the stamp read (5 ms), and
// scripts/test-deps.sh with a warm bed about 2 s, mostly `go run`.
//
// Programs run inside the bed through its enter script, in a private mount
// namespace per run (unshare -m, then chroot): /proc, /dev, /sys, the host's
// /etc/hosts and the host's temporary directory are visible there at the
// same paths, and nothing stays mounted on the host, even when a run is
// killed. Python scripts a test writes to t.TempDir() therefore run in the
// bed unchanged, and the bed's wrappers (Bed.Python, Bed.Torchrun) serve as
// PYTHON_EXEC for gorun on the host.
//
// Two things in the bed are the bed's, never gorun's: apt ignores the
// mirror's expired Valid-Until, and a start-up hook makes TCPStore's classic
// backend the default (Debian's torch is built without libuv; see
// scripts.go).
package sidbed

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"time"
)

// DefaultDir is where the bed is cached unless $GORUN_SID_BED says
// otherwise. It holds root/ (the chroot), enter, bin/ and stamp.json.
const DefaultDir = "/var/cache/gorun/sid-bed"

// EnvDir overrides DefaultDir.
const EnvDir = "GORUN_SID_BED"

// DefaultMirror is used when the host's apt sources name no Debian mirror.
const DefaultMirror = "http://deb.debian.org/debian"

// Format is the bed's layout version: a stamp of another format is a bed
// to rebuild. Bump it when the scripts or the package list change.
const Format = 1

// Packages are what the bed installs on top of debootstrap's minbase.
var Packages = []string{"python3-torch", "libnccl2", "libnccl-dev"}

// Config configures Build.
type Config struct {
	// Dir is where the bed lives. Default: $GORUN_SID_BED, else DefaultDir.
	Dir string
	// Mirror is the Debian archive to debootstrap from. Default: the first
	// Debian archive in the host's apt sources, else DefaultMirror.
	Mirror string
	// Suite is the Debian suite. Default "sid".
	Suite string
	// Log receives the tools' output, which Build also keeps in Dir+".log"
	// (named in its errors). Default: the file only.
	Log io.Writer
}

func (c Config) withDefaults() Config {
	if c.Dir == "" {
		c.Dir = dir()
	}
	if c.Mirror == "" {
		c.Mirror = HostMirror()
	}
	if c.Suite == "" {
		c.Suite = "sid"
	}
	if c.Log == nil {
		c.Log = io.Discard
	}
	return c
}

func dir() string {
	if d := os.Getenv(EnvDir); d != "" {
		return d
	}
	return DefaultDir
}

// Stamp is what stamp.json records about a built bed.
type Stamp struct {
	Format int    `json:"format"`
	Suite  string `json:"suite"`
	Mirror string `json:"mirror"`
	// Packages maps each installed package of Packages to its Debian
	// version.
	Packages map[string]string `json:"packages"`
	// Torch is torch.__version__ inside the bed.
	Torch string `json:"torch"`
	// NCCL is libnccl2's upstream version (X.Y.Z).
	NCCL    string    `json:"nccl"`
	Built   time.Time `json:"built"`
	BuildMS int64     `json:"build_ms"`
}

// Bed is a built bed.
type Bed struct {
	Dir   string
	Stamp Stamp
}

// ErrNotBuilt is returned by Find when there is no usable bed.
var ErrNotBuilt = errors.New("sidbed: no sid bed")

// Find returns the bed at $GORUN_SID_BED or DefaultDir if its stamp is of
// the current Format and its entry points exist. It runs nothing.
func Find() (*Bed, error) {
	return FindAt(dir())
}

// FindAt is Find for a given directory.
func FindAt(d string) (*Bed, error) {
	b, err := os.ReadFile(filepath.Join(d, "stamp.json"))
	if err != nil {
		return nil, fmt.Errorf("%w at %s (build it as root: go run ./internal/sidbed/cmd/sidbed build, or make test-deps): %w", ErrNotBuilt, d, err)
	}
	var s Stamp
	if err := json.Unmarshal(b, &s); err != nil {
		return nil, fmt.Errorf("%w: %s: %w", ErrNotBuilt, filepath.Join(d, "stamp.json"), err)
	}
	if s.Format != Format {
		return nil, fmt.Errorf("%w: %s is format %d, want %d (rebuild it)", ErrNotBuilt, d, s.Format, Format)
	}
	bed := &Bed{Dir: d, Stamp: s}
	for _, p := range []string{bed.Enter(), bed.Python(), bed.Path("/usr/bin/python3")} {
		if _, err := os.Stat(p); err != nil {
			return nil, fmt.Errorf("%w: %w", ErrNotBuilt, err)
		}
	}
	return bed, nil
}

// Enter is the host path of the script that runs a program in the bed.
func (b *Bed) Enter() string { return filepath.Join(b.Dir, "enter") }

// Python is the host path of a python3 that runs in the bed.
func (b *Bed) Python() string { return filepath.Join(b.Dir, "bin", "python3") }

// Torchrun is the host path of a torchrun that runs in the bed.
func (b *Bed) Torchrun() string { return filepath.Join(b.Dir, "bin", "torchrun") }

// Path is the host path of p, a path inside the bed.
func (b *Bed) Path(p string) string { return filepath.Join(b.Dir, "root", p) }

// NCCLLibrary is the host path of the bed's libnccl.so.2.
func (b *Bed) NCCLLibrary() string {
	return b.Path("/usr/lib/x86_64-linux-gnu/libnccl.so.2")
}

// Command returns a command that runs name (a path inside the bed) with
// args in the bed, from the caller's working directory when the bed sees
// it (the temporary directory), else from /.
func (b *Bed) Command(ctx context.Context, name string, args ...string) *exec.Cmd {
	return exec.CommandContext(ctx, b.Enter(), append([]string{name}, args...)...)
}

// Build makes the bed unless one of the current Format is already there,
// and returns it. It needs root, debootstrap and the network to the mirror.
// A bed is built in a sibling directory and renamed into place, so a
// failed or interrupted build leaves no half bed behind; concurrent Builds
// wait for each other.
func Build(ctx context.Context, cfg Config) (*Bed, error) {
	cfg = cfg.withDefaults()
	if os.Geteuid() != 0 {
		return nil, errors.New("sidbed: building the bed needs root (debootstrap, chroot, mounts)")
	}
	for _, tool := range []string{"debootstrap", "unshare", "chroot", "mount"} {
		if _, err := exec.LookPath(tool); err != nil {
			return nil, fmt.Errorf("sidbed: %s: %w", tool, err)
		}
	}
	if err := os.MkdirAll(filepath.Dir(cfg.Dir), 0o755); err != nil {
		return nil, fmt.Errorf("sidbed: %w", err)
	}
	unlock, err := lock(ctx, cfg.Dir+".lock")
	if err != nil {
		return nil, err
	}
	defer unlock()
	if bed, err := FindAt(cfg.Dir); err == nil {
		return bed, nil
	}
	logPath := cfg.Dir + ".log"
	logFile, err := os.Create(logPath)
	if err != nil {
		return nil, fmt.Errorf("sidbed: %w", err)
	}
	defer logFile.Close()
	cfg.Log = io.MultiWriter(cfg.Log, logFile)
	start := time.Now()
	tmp := cfg.Dir + ".building"
	if err := os.RemoveAll(tmp); err != nil {
		return nil, fmt.Errorf("sidbed: %w", err)
	}
	stamp, err := build(ctx, cfg, tmp)
	if err != nil {
		_ = os.RemoveAll(tmp)
		return nil, fmt.Errorf("%w (log: %s)", err, logPath)
	}
	stamp.Built = time.Now().UTC().Truncate(time.Second)
	stamp.BuildMS = time.Since(start).Milliseconds()
	sb, _ := json.MarshalIndent(stamp, "", "  ")
	if err := os.WriteFile(filepath.Join(tmp, "stamp.json"), append(sb, '\n'), 0o644); err != nil {
		return nil, fmt.Errorf("sidbed: %w", err)
	}
	if err := os.RemoveAll(cfg.Dir); err != nil {
		return nil, fmt.Errorf("sidbed: removing the old bed: %w", err)
	}
	if err := os.Rename(tmp, cfg.Dir); err != nil {
		return nil, fmt.Errorf("sidbed: %w", err)
	}
	return FindAt(cfg.Dir)
}

// build makes a bed in d and returns its stamp (without the build time).
func build(ctx context.Context, cfg Config, d string) (Stamp, error) {
	root := filepath.Join(d, "root")
	if err := os.MkdirAll(root, 0o755); err != nil {
		return Stamp{}, fmt.Errorf("sidbed: %w", err)
	}
	// debootstrap mounts /proc and /sys in the target while it installs and
	// may leave them mounted when it fails: a private namespace takes them
	// away whatever happens.
	if err := run(ctx, cfg.Log, nil, "unshare", "--mount", "--propagation", "private", "--",
		"debootstrap", "--variant=minbase", "--components=main,contrib", cfg.Suite, root, cfg.Mirror); err != nil {
		return Stamp{}, fmt.Errorf("sidbed: debootstrap %s from %s: %w", cfg.Suite, cfg.Mirror, err)
	}
	files := []struct {
		path string
		body string
		mode os.FileMode
	}{
		{filepath.Join(d, "enter"), enterScript, 0o755},
		{filepath.Join(d, "bin", "python3"), pythonWrapper, 0o755},
		{filepath.Join(d, "bin", "torchrun"), torchrunWrapper, 0o755},
		{filepath.Join(root, "etc/apt/apt.conf.d/99gorun-sid-bed"), aptConf, 0o644},
		{filepath.Join(root, "etc/apt/sources.list"), fmt.Sprintf("deb %s %s main contrib\n", cfg.Mirror, cfg.Suite), 0o644},
		{filepath.Join(root, "etc/hosts"), "", 0o644}, // a mount point for the host's
	}
	for _, f := range files {
		if err := writeFile(f.path, f.body, f.mode); err != nil {
			return Stamp{}, err
		}
	}
	bed := &Bed{Dir: d}
	env := []string{"DEBIAN_FRONTEND=noninteractive", "LC_ALL=C.UTF-8", "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"}
	for _, args := range [][]string{
		{"apt-get", "update", "-q"},
		append([]string{"apt-get", "install", "-y", "-q"}, Packages...),
		{"apt-get", "clean"},
	} {
		if err := run(ctx, cfg.Log, env, bed.Enter(), args...); err != nil {
			return Stamp{}, fmt.Errorf("sidbed: in the bed, %s: %w", strings.Join(args, " "), err)
		}
	}
	pyver, err := output(ctx, env, bed.Enter(), "/usr/bin/python3", "-c", "import sys; print(f'{sys.version_info[0]}.{sys.version_info[1]}')")
	if err != nil {
		return Stamp{}, fmt.Errorf("sidbed: python3 in the bed: %w", err)
	}
	site := filepath.Join(root, "usr/local/lib/python"+pyver, "dist-packages")
	if err := writeFile(filepath.Join(site, "gorun_sid_bed_classic.py"), classicHook, 0o644); err != nil {
		return Stamp{}, err
	}
	if err := writeFile(filepath.Join(site, "gorun_sid_bed_classic.pth"), classicPth, 0o644); err != nil {
		return Stamp{}, err
	}
	s := Stamp{Format: Format, Suite: cfg.Suite, Mirror: cfg.Mirror, Packages: map[string]string{}}
	for _, p := range Packages {
		v, err := output(ctx, env, bed.Enter(), "dpkg-query", "-W", "-f", "${Version}", p)
		if err != nil {
			return Stamp{}, fmt.Errorf("sidbed: %s is not installed in the bed: %w", p, err)
		}
		s.Packages[p] = v
	}
	s.NCCL = upstreamVersion(s.Packages["libnccl2"])
	// The classic backend must now be the default, or torchrun fails.
	s.Torch, err = output(ctx, env, bed.Enter(), "/usr/bin/python3", "-c",
		"import torch, torch.distributed as d\n"+
			"s = d.TCPStore('127.0.0.1', 0, None, True)\n"+
			"assert not s.libuvBackend, 'libuv backend is the default'\n"+
			"print(torch.__version__)")
	if err != nil {
		return Stamp{}, fmt.Errorf("sidbed: torch in the bed: %w", err)
	}
	return s, nil
}

// upstreamVersion is X.Y.Z of a Debian version like 2.29.7-1 or
// 1:2.29.7-1+b1.
func upstreamVersion(v string) string {
	if i := strings.IndexByte(v, ':'); i >= 0 {
		v = v[i+1:]
	}
	if i := strings.IndexAny(v, "-+~"); i >= 0 {
		v = v[:i]
	}
	return v
}

func writeFile(path, body string, mode os.FileMode) error {
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return fmt.Errorf("sidbed: %w", err)
	}
	if err := os.WriteFile(path, []byte(body), mode); err != nil {
		return fmt.Errorf("sidbed: %w", err)
	}
	return os.Chmod(path, mode)
}

func run(ctx context.Context, log io.Writer, env []string, name string, args ...string) error {
	cmd := exec.CommandContext(ctx, name, args...)
	cmd.Stdout, cmd.Stderr = log, log
	if env != nil {
		cmd.Env = append(os.Environ(), env...)
	}
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	cmd.Cancel = func() error { return syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL) }
	return cmd.Run()
}

func output(ctx context.Context, env []string, name string, args ...string) (string, error) {
	cmd := exec.CommandContext(ctx, name, args...)
	if env != nil {
		cmd.Env = append(os.Environ(), env...)
	}
	var stderr strings.Builder
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		return "", fmt.Errorf("%w: %s", err, strings.TrimSpace(stderr.String()))
	}
	return strings.TrimSpace(string(out)), nil
}

// lock takes an exclusive flock on path, waiting for ctx.
func lock(ctx context.Context, path string) (func(), error) {
	f, err := os.OpenFile(path, os.O_CREATE|os.O_RDWR, 0o644)
	if err != nil {
		return nil, fmt.Errorf("sidbed: %w", err)
	}
	for {
		err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB)
		if err == nil {
			return func() { f.Close() }, nil
		}
		if !errors.Is(err, syscall.EWOULDBLOCK) {
			f.Close()
			return nil, fmt.Errorf("sidbed: lock %s: %w", path, err)
		}
		select {
		case <-ctx.Done():
			f.Close()
			return nil, fmt.Errorf("sidbed: waiting for another build (%s): %w", path, ctx.Err())
		case <-time.After(200 * time.Millisecond):
		}
	}
}

// HostMirror returns the first Debian archive (not the security one) that
// the host's apt sources name, else DefaultMirror.
func HostMirror() string {
	files, _ := filepath.Glob("/etc/apt/sources.list.d/*.sources")
	files = append(files, "/etc/apt/sources.list")
	more, _ := filepath.Glob("/etc/apt/sources.list.d/*.list")
	files = append(files, more...)
	for _, f := range files {
		if m := mirrorIn(f); m != "" {
			return m
		}
	}
	return DefaultMirror
}

// mirrorIn reads one sources file (deb822 or one-line style).
func mirrorIn(path string) string {
	f, err := os.Open(path)
	if err != nil {
		return ""
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		var uris []string
		switch {
		case strings.HasPrefix(line, "URIs:"):
			uris = strings.Fields(strings.TrimPrefix(line, "URIs:"))
		case strings.HasPrefix(line, "deb "):
			for _, w := range strings.Fields(line)[1:] {
				if !strings.HasPrefix(w, "[") && strings.Contains(w, "://") {
					uris = append(uris, w)
					break
				}
			}
		}
		for _, u := range uris {
			if isDebianArchive(u) {
				return strings.TrimSuffix(u, "/")
			}
		}
	}
	return ""
}

// isDebianArchive: a Debian archive URL, not its security archive.
func isDebianArchive(u string) bool {
	u = strings.TrimSuffix(u, "/")
	return strings.HasSuffix(u, "/debian") && !strings.Contains(u, "security")
}

// ResolvePython resolves a command-line choice of the bed's interpreter, as
// the benchmarks take it: "auto" is the bed's python3 when a bed is built,
// else "" with the reason; any other value is returned as it is ("" for
// none).
func ResolvePython(choice string) (string, error) {
	if choice != "auto" {
		return choice, nil
	}
	bed, err := Find()
	if err != nil {
		return "", err
	}
	return bed.Python(), nil
}
