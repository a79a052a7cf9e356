package launcher

import (
	"bufio"
	"errors"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// console is where workers' lines go when they reach the terminal: the
// agent's stdout and stderr, each written a whole line at a time so that
// workers' lines never interleave mid-line.
type console struct {
	mu             sync.Mutex
	stdout, stderr io.Writer
}

func (c *console) writeLine(stream Std, prefix string, line []byte) {
	w := c.stdout
	if stream == StdErr {
		w = c.stderr
	}
	buf := make([]byte, 0, len(prefix)+len(line)+1)
	buf = append(buf, prefix...)
	buf = append(buf, line...)
	if len(line) == 0 || line[len(line)-1] != '\n' {
		buf = append(buf, '\n')
	}
	c.mu.Lock()
	w.Write(buf)
	c.mu.Unlock()
}

// workerOutput routes one worker's stdout and stderr, as torchrun does:
// a stream named in --tee goes to its log file and the console (torchrun
// adds tee to the redirects); one named only in --redirects goes to the
// file alone; any other stream goes to the console. A console line carries the worker's prefix ("[default0]:"), and
// ranks outside --local-ranks-filter do not reach the console at all.
type workerOutput struct {
	files   []*os.File // opened log files, closed when the copies end
	readers []*os.File // the agent's ends of the pipes
	writers []*os.File // the worker's ends; closed once the worker started
	streams [2]*stream // stdout's and stderr's way
	wg      sync.WaitGroup
	// prefix is what the worker's console lines start with; a parked
	// worker's changes when it gets its assignment (its rank).
	prefix atomic.Pointer[string]
}

// setPrefix changes the prefix of the lines copied from now on.
func (o *workerOutput) setPrefix(p string) { o.prefix.Store(&p) }

// stream is where one of a worker's streams goes: its plan and file, or,
// for a standby that has no slot yet (openHeldOutput), nowhere until
// route: its lines are held meanwhile.
type stream struct {
	con  *console
	mu   sync.Mutex
	plan streamPlan
	file *os.File
	// held are the lines of a stream not routed yet, at most
	// maxHeldOutput bytes of the latest (heldBytes); dropped counts the
	// earlier ones let go.
	routed    bool
	held      [][]byte
	heldBytes int
	dropped   int
}

// maxHeldOutput bounds what a standby's stream holds before it takes a
// slot: its start-up's lines, not a log.
const maxHeldOutput = 1 << 20

// write sends one line where the stream goes, or holds it.
func (st *stream) write(prefix string, line []byte) {
	st.mu.Lock()
	defer st.mu.Unlock()
	if !st.routed {
		st.held = append(st.held, slices.Clone(line))
		st.heldBytes += len(line)
		for st.heldBytes > maxHeldOutput && len(st.held) > 1 {
			st.heldBytes -= len(st.held[0])
			st.held = st.held[1:]
			st.dropped++
		}
		return
	}
	st.emit(prefix, line)
}

// emit sends line where the routed stream goes; st.mu must be held.
func (st *stream) emit(prefix string, line []byte) {
	if st.file != nil {
		st.file.Write(line)
	}
	if st.plan.toConsole {
		st.con.writeLine(st.plan.stream, prefix, line)
	}
	st.plan.filtered.offer(prefix, line)
}

// streamPlan says where one stream goes.
type streamPlan struct {
	stream Std
	toFile string // "" for none
	// appendFile adds to toFile instead of starting it afresh: a
	// respawned worker's lines follow its predecessor's.
	appendFile bool
	toConsole  bool
	// filtered, for a tee'd stream, takes the lines that match
	// --duplicate-std*-filters; nil for none.
	filtered *filteredLog
}

// routes decides where a worker's two streams go; filtered are the
// attempt's filtered logs of stdout and stderr (nil when not asked for),
// which take the tee'd streams' matching lines.
func routes(cfg *Config, localRank int, dir string, filtered [2]*filteredLog) [2]streamPlan {
	redirect, tee := cfg.Redirects.For(localRank), cfg.Tee.For(localRank)
	shown := cfg.LocalRanksFilter == nil || contains(cfg.LocalRanksFilter, localRank)
	var p [2]streamPlan
	for i, s := range []Std{StdOut, StdErr} {
		name := "stdout.log"
		if s == StdErr {
			name = "stderr.log"
		}
		p[i] = streamPlan{stream: s}
		switch {
		case tee&s != 0:
			p[i].toFile = filepath.Join(dir, name)
			p[i].toConsole = shown
			p[i].filtered = filtered[i]
		case redirect&s != 0:
			p[i].toFile = filepath.Join(dir, name)
		default:
			p[i].toConsole = shown
		}
	}
	return p
}

func contains(xs []int, x int) bool {
	for _, v := range xs {
		if v == x {
			return true
		}
	}
	return false
}

// openOutput makes the pipes and files for one worker and starts copying.
// The returned files are the worker's stdout and stderr.
func openOutput(con *console, prefix string, plans [2]streamPlan) (*workerOutput, [2]*os.File, error) {
	o, ends, err := openHeldOutput(con)
	if err != nil {
		return nil, ends, err
	}
	o.setPrefix(prefix)
	if err := o.route(plans); err != nil {
		o.abort()
		return nil, ends, err
	}
	return o, ends, nil
}

// openHeldOutput makes the pipes for a standby, whose slot and so whose
// logs are not known yet, and starts copying: its lines are held until
// route.
func openHeldOutput(con *console) (*workerOutput, [2]*os.File, error) {
	o := &workerOutput{}
	o.setPrefix("")
	var ends [2]*os.File
	for i := range o.streams {
		r, w, err := os.Pipe()
		if err != nil {
			o.abort()
			return nil, ends, err
		}
		o.readers = append(o.readers, r)
		o.writers = append(o.writers, w)
		ends[i] = w
		o.streams[i] = &stream{con: con}
		o.wg.Add(1)
		go o.copy(r, o.streams[i])
	}
	return o, ends, nil
}

// route sends the streams where plans say, from now on, starting with
// what they held: the files are opened (and added to, with appendFile)
// here.
func (o *workerOutput) route(plans [2]streamPlan) error {
	var files [2]*os.File
	for i, p := range plans {
		if p.toFile == "" {
			continue
		}
		mode := os.O_TRUNC
		if p.appendFile {
			mode = os.O_APPEND
		}
		f, err := os.OpenFile(p.toFile, os.O_CREATE|os.O_WRONLY|mode, 0o644)
		if err != nil {
			for _, f := range files {
				if f != nil {
					f.Close()
				}
			}
			return err
		}
		files[i] = f
	}
	prefix := *o.prefix.Load()
	for i, st := range o.streams {
		if files[i] != nil {
			o.files = append(o.files, files[i])
		}
		st.mu.Lock()
		st.plan, st.file, st.routed = plans[i], files[i], true
		for _, line := range st.held { // before any later line: the lock is held
			st.emit(prefix, line)
		}
		st.held, st.heldBytes = nil, 0
		st.mu.Unlock()
	}
	return nil
}

// heldTail returns the last n bytes or less of what stream i (0 stdout,
// 1 stderr) holds, whole lines, and how many earlier lines it let go.
func (o *workerOutput) heldTail(i, n int) (string, int) {
	st := o.streams[i]
	st.mu.Lock()
	defer st.mu.Unlock()
	var b []byte
	for k := len(st.held) - 1; k >= 0 && len(b)+len(st.held[k]) <= n; k-- {
		b = append(slices.Clone(st.held[k]), b...)
	}
	return strings.TrimRight(string(b), "\n"), st.dropped
}

// copy moves one stream line by line until the worker (and any child that
// inherited the stream) closes it.
func (o *workerOutput) copy(r *os.File, st *stream) {
	defer o.wg.Done()
	br := bufio.NewReaderSize(r, 64<<10)
	for {
		line, err := br.ReadSlice('\n')
		if errors.Is(err, bufio.ErrBufferFull) {
			err = nil // an overlong line goes out in pieces
		}
		if len(line) > 0 {
			st.write(*o.prefix.Load(), line)
		}
		if err != nil {
			return
		}
	}
}

// started closes the agent's copies of the worker's ends, so that the
// copies see EOF when the worker exits.
func (o *workerOutput) started() {
	for _, w := range o.writers {
		w.Close()
	}
	o.writers = nil
}

// drain waits up to d for the copies to reach EOF, then closes the pipes
// (which ends copies still blocked on a pipe that an escaped grandchild
// holds open) and the files.
func (o *workerOutput) drain(d time.Duration) {
	done := make(chan struct{})
	go func() { o.wg.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(d):
	}
	for _, r := range o.readers {
		r.Close()
	}
	<-done
	for _, f := range o.files {
		f.Close()
	}
}

// abort closes everything (the worker never started).
func (o *workerOutput) abort() {
	for _, f := range o.writers {
		f.Close()
	}
	o.writers = nil
	o.drain(0)
}

// filteredLog is an attempt's filtered_stdout.log or filtered_stderr.log:
// the lines of tee'd streams that contain one of the needles, prefixed as
// on the console, from every worker of the attempt.
type filteredLog struct {
	needles []string
	mu      sync.Mutex
	f       *os.File
}

// openFilteredLog creates path for needles; nil, nil when there are none.
func openFilteredLog(path string, needles []string) (*filteredLog, error) {
	if len(needles) == 0 {
		return nil, nil
	}
	f, err := os.OpenFile(path, os.O_CREATE|os.O_WRONLY|os.O_TRUNC, 0o644)
	if err != nil {
		return nil, err
	}
	return &filteredLog{needles: needles, f: f}, nil
}

// offer writes line, prefixed, when it contains a needle.
func (l *filteredLog) offer(prefix string, line []byte) {
	if l == nil {
		return
	}
	for _, n := range l.needles {
		if strings.Contains(string(line), n) {
			buf := append([]byte(prefix), line...)
			if len(line) == 0 || line[len(line)-1] != '\n' {
				buf = append(buf, '\n')
			}
			l.mu.Lock()
			l.f.Write(buf)
			l.mu.Unlock()
			return
		}
	}
}

func (l *filteredLog) close() {
	if l != nil {
		l.f.Close()
	}
}
