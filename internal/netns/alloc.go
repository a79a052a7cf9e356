package netns

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"time"

	"golang.org/x/sys/unix"
)

// Beds are told apart by an index, unique among the beds that exist on the
// machine at one time, whichever test binary made them: `go test ./...`
// runs packages in parallel. An index is taken under a file lock by writing
// a state file that names its owner (PID and start time); it is free again
// when the owner's Close removes the file, or when the owner is gone and
// the next allocation sweeps what it left.
const (
	// stateDir holds the lock and one state file per bed, "b<index>". It
	// is on /run, a tmpfs like /run/netns, so both vanish at reboot.
	stateDir = "/run/gorun-netns"
	// nsPrefix starts every namespace of a bed: gorun-b<index>-sw and
	// gorun-b<index>-h<host>.
	nsPrefix = "gorun-b"
	// maxBeds is how many /24s 198.18.0.0/15 holds.
	maxBeds = 512
	// sweepKillTimeout bounds the wait for a stale bed's processes.
	sweepKillTimeout = 10 * time.Second
)

// ErrNoFreeBed: every index is taken by a live bed, by a stale bed that
// could not be removed, or by an address of this machine.
var ErrNoFreeBed = errors.New("netns: no free bed index")

// subnet returns bed idx's /24. 198.18.0.0/15 is RFC 2544's benchmarking
// range: never routed on the Internet and unlikely to sit on a machine's
// interfaces (allocate checks anyway).
func subnet(idx int) netip.Prefix {
	return netip.PrefixFrom(netip.AddrFrom4([4]byte{198, byte(18 + idx/256), byte(idx % 256), 0}), 24)
}

func gatewayLink(idx int) string { return fmt.Sprintf("gorun%dgw", idx) }
func switchNS(idx int) string    { return fmt.Sprintf("%s%d-sw", nsPrefix, idx) }
func hostNS(idx, i int) string   { return fmt.Sprintf("%s%d-h%d", nsPrefix, idx, i) }
func statePath(idx int) string   { return filepath.Join(stateDir, fmt.Sprintf("b%d", idx)) }

// owner names a process across PID reuse.
type owner struct {
	pid   int
	start uint64
}

func self() (owner, error) {
	start, err := procStart(os.Getpid())
	return owner{os.Getpid(), start}, err
}

func (o owner) String() string { return fmt.Sprintf("%d %d\n", o.pid, o.start) }

func parseOwner(s string) (owner, error) {
	var o owner
	if _, err := fmt.Sscanf(s, "%d %d", &o.pid, &o.start); err != nil {
		return owner{}, fmt.Errorf("netns: bad state %q: %w", s, err)
	}
	return o, nil
}

// alive reports whether the owner process still runs.
func (o owner) alive() bool {
	start, err := procStart(o.pid)
	return err == nil && start == o.start
}

// allocate sweeps stale beds, takes a free index and writes its state
// file, all under the lock.
func allocate(ipPath string) (idx int, state string, err error) {
	me, err := self()
	if err != nil {
		return 0, "", err
	}
	unlock, err := lockState()
	if err != nil {
		return 0, "", err
	}
	defer unlock()
	used, sweepErr := sweep(ipPath)
	ours, err := localPrefixes()
	if err != nil {
		return 0, "", err
	}
	for idx := range maxBeds {
		if used[idx] || overlaps(ours, subnet(idx)) {
			continue
		}
		state := statePath(idx)
		if err := os.WriteFile(state, []byte(me.String()), 0o644); err != nil {
			return 0, "", err
		}
		return idx, state, nil
	}
	return 0, "", errors.Join(ErrNoFreeBed, sweepErr)
}

// lockState takes the lock that allocations and sweeps hold, across
// processes, and returns its release.
func lockState() (unlock func(), err error) {
	if err := os.MkdirAll(stateDir, 0o755); err != nil {
		return nil, err
	}
	f, err := os.OpenFile(filepath.Join(stateDir, "lock"), os.O_CREATE|os.O_RDWR, 0o644)
	if err != nil {
		return nil, err
	}
	if err := unix.Flock(int(f.Fd()), unix.LOCK_EX); err != nil {
		f.Close()
		return nil, fmt.Errorf("netns: lock %s: %w", f.Name(), err)
	}
	return func() { f.Close() }, nil // closing releases the lock
}

// sweep removes the beds whose owner is gone, and what a bed whose state
// file is gone left behind, and returns the indexes that stay taken: live
// beds and stale ones it could not remove (their errors joined).
func sweep(ipPath string) (used map[int]bool, err error) {
	used = map[int]bool{}
	stale := map[int][]string{} // index → its namespaces
	states, _ := os.ReadDir(stateDir)
	for _, e := range states {
		idx, ok := matchIndex(stateRE, e.Name())
		if !ok {
			continue
		}
		b, rerr := os.ReadFile(filepath.Join(stateDir, e.Name()))
		o, perr := parseOwner(string(b))
		if rerr == nil && perr == nil && o.alive() {
			used[idx] = true
			continue
		}
		stale[idx] = nil
	}
	// Leftovers of a failed Close have no state file any more.
	nss, _ := os.ReadDir(netnsDir)
	for _, e := range nss {
		if idx, ok := matchIndex(nsRE, e.Name()); ok && !used[idx] {
			stale[idx] = append(stale[idx], e.Name())
		}
	}
	links, _ := os.ReadDir("/sys/class/net")
	for _, e := range links {
		if idx, ok := matchIndex(linkRE, e.Name()); ok && !used[idx] {
			if _, seen := stale[idx]; !seen {
				stale[idx] = nil
			}
		}
	}
	for idx, nss := range stale {
		if terr := teardown(ipPath, nss, gatewayLink(idx), statePath(idx), sweepKillTimeout); terr != nil {
			used[idx] = true
			err = errors.Join(err, fmt.Errorf("stale bed %d: %w", idx, terr))
		}
	}
	return used, err
}

// Names of a bed's parts, with the index in the first group.
var (
	stateRE = regexp.MustCompile(`^b([0-9]{1,3})$`)
	nsRE    = regexp.MustCompile(`^` + nsPrefix + `([0-9]{1,3})-`)
	linkRE  = regexp.MustCompile(`^gorun([0-9]{1,3})gw$`)
)

// matchIndex returns the bed index in name, if name is a bed's part.
func matchIndex(re *regexp.Regexp, name string) (int, bool) {
	m := re.FindStringSubmatch(name)
	if m == nil {
		return 0, false
	}
	idx, err := strconv.Atoi(m[1])
	if err != nil || idx >= maxBeds {
		return 0, false
	}
	return idx, true
}

// localPrefixes returns the networks of the root namespace's addresses.
func localPrefixes() ([]netip.Prefix, error) {
	addrs, err := net.InterfaceAddrs()
	if err != nil {
		return nil, fmt.Errorf("netns: %w", err)
	}
	var ps []netip.Prefix
	for _, a := range addrs {
		if n, ok := a.(*net.IPNet); ok {
			if p, err := netip.ParsePrefix(n.String()); err == nil {
				ps = append(ps, p.Masked())
			}
		}
	}
	return ps, nil
}

func overlaps(ps []netip.Prefix, p netip.Prefix) bool {
	for _, q := range ps {
		if q.Overlaps(p) {
			return true
		}
	}
	return false
}
