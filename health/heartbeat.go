package health

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"
)

// HeartbeatEnv names the variable that tells a worker where to send its
// heartbeats: the path of the agent's unix datagram socket.
const HeartbeatEnv = "GORUN_HEARTBEAT"

// HeartbeatTimeoutEnv names the variable that tells a worker the agent's
// heartbeat timeout, in seconds: how often it must beat while blocked.
const HeartbeatTimeoutEnv = "GORUN_HEARTBEAT_TIMEOUT"

// beatKind is what a heartbeat says.
type beatKind int

const (
	beatProgress beatKind = iota // a step done
	beatWait                     // alive, blocked on its peers
	beatDone                     // training over: no longer watched for beats; its exit is awaited (within the done timeout, if set)
)

// A heartbeat is one datagram whose payload starts with the worker's local
// rank in decimal: a progress beat. A second word "wait" makes it a wait
// beat (the worker is alive and blocked on its peers), "done" a done beat
// (its training is over; its teardown, however long, is no hang);
// anything else after the first space is ignored. In Python:
//
//	s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
//	s.sendto(os.environ["LOCAL_RANK"].encode(), os.environ["GORUN_HEARTBEAT"])          # a step done
//	s.sendto((os.environ["LOCAL_RANK"] + " wait").encode(), os.environ["GORUN_HEARTBEAT"]) # blocked, alive
//	s.sendto((os.environ["LOCAL_RANK"] + " done").encode(), os.environ["GORUN_HEARTBEAT"]) # finished
func parseBeat(b []byte) (rank int, kind beatKind, err error) {
	s, rest, _ := strings.Cut(strings.TrimSpace(string(b)), " ")
	rank, err = strconv.Atoi(s)
	if err != nil || rank < 0 {
		return 0, 0, fmt.Errorf("heartbeat %q: want a local rank", b)
	}
	switch word, _, _ := strings.Cut(strings.TrimSpace(rest), " "); word {
	case "wait":
		return rank, beatWait, nil
	case "done":
		return rank, beatDone, nil
	}
	return rank, beatProgress, nil
}

// Monitor receives heartbeats on a unix datagram socket and reports workers
// whose heartbeats stop. It is the I/O around a HangDetector.
//
// A local rank is one worker after another (a respawn, the next round's),
// and what one of them sent must not count for the next: a worker that
// exits is forgotten (Forget), and the beats that still come for its rank
// (a datagram it sent as it exited, read after its exit was handled) are
// dropped until a worker starts in that rank again (Start, Expect);
// reports about it not yet taken are withdrawn. Reports wait in Run for
// the caller, which may not be listening (an agent between rounds), while
// beats go on being read: a stale "done" once stood in line there for
// the next round and was taken for its new worker's, which was killed as
// finished and ended the job.
type Monitor struct {
	conn    *net.UnixConn
	path    string
	det     *HangDetector
	forget  chan int
	start   chan int
	expect  chan []int
	ended   chan struct{} // closed when Run returns: Forget and Expect no longer wait for it
	closing chan struct{}
	once    sync.Once
}

// ListenHeartbeats binds a unix datagram socket at path (removing a stale
// socket file first) and returns a Monitor declaring workers hung after
// timeout without a beat.
func ListenHeartbeats(path string, timeout time.Duration) (*Monitor, error) {
	if timeout <= 0 {
		return nil, fmt.Errorf("heartbeat timeout %v: must be positive", timeout)
	}
	if err := os.Remove(path); err != nil && !errors.Is(err, os.ErrNotExist) {
		return nil, fmt.Errorf("heartbeat socket %s: %w", path, err)
	}
	conn, err := net.ListenUnixgram("unixgram", &net.UnixAddr{Name: path, Net: "unixgram"})
	if err != nil {
		return nil, fmt.Errorf("heartbeat socket: %w", err)
	}
	return &Monitor{
		conn: conn, path: path, det: NewHangDetector(timeout),
		forget: make(chan int), start: make(chan int), expect: make(chan []int), ended: make(chan struct{}), closing: make(chan struct{}),
	}, nil
}

// Path is the socket's path, the value of GORUN_HEARTBEAT for workers.
func (m *Monitor) Path() string { return m.path }

type beat struct {
	rank int
	kind beatKind
	at   time.Time
}

// Run reads heartbeats and sends an Event on events for every worker that
// stops beating, until ctx is done or the Monitor is closed. Malformed
// datagrams are ignored. Events wait in Run until events takes them (or
// their worker is forgotten); beats are handled meanwhile.
func (m *Monitor) Run(ctx context.Context, events chan<- Event) error {
	defer close(m.ended)
	beats := make(chan beat, 64)
	readErr := make(chan error, 1)
	go func() { readErr <- m.read(beats) }()

	var pending []Event
	gone := map[int]bool{} // forgotten and not started again
	timer := time.NewTimer(time.Hour)
	defer timer.Stop()
	rearm := func() {
		timer.Stop()
		if next, ok := m.det.Next(); ok {
			timer.Reset(time.Until(next))
		}
	}
	rearm()
	for {
		var out chan<- Event // nil (never ready) with nothing to send
		var first Event
		if len(pending) > 0 {
			out, first = events, pending[0]
		}
		select {
		case <-ctx.Done():
			m.Close()
			<-readErr
			return ctx.Err()
		case <-m.closing:
			<-readErr
			return nil
		case err := <-readErr:
			return err
		case out <- first:
			pending = pending[1:]
		case b := <-beats:
			if gone[b.rank] {
				continue // its worker's last words, read after it was forgotten
			}
			switch b.kind {
			case beatWait:
				m.det.Wait(b.rank, b.at)
			case beatDone:
				m.det.Done(b.rank, b.at)
			default:
				m.det.Beat(b.rank, b.at)
			}
			rearm()
		case rank := <-m.forget:
			m.det.Forget(rank)
			gone[rank] = true
			pending = slices.DeleteFunc(pending, func(ev Event) bool { return ev.Rank == rank })
			rearm()
		case rank := <-m.start:
			delete(gone, rank)
		case ranks := <-m.expect:
			for _, r := range ranks {
				delete(gone, r)
			}
			m.det.Expect(ranks)
		case now := <-timer.C:
			pending = append(pending, m.det.Expired(now)...)
			rearm()
		}
	}
}

// read forwards beats until the socket is closed.
func (m *Monitor) read(beats chan<- beat) error {
	buf := make([]byte, 128)
	for {
		n, _, err := m.conn.ReadFromUnix(buf)
		if err != nil {
			select {
			case <-m.closing:
				return nil
			default:
				return fmt.Errorf("heartbeat socket: %w", err)
			}
		}
		rank, kind, err := parseBeat(buf[:n])
		if err != nil {
			continue
		}
		select {
		case beats <- beat{rank, kind, time.Now()}:
		case <-m.closing:
			return nil
		}
	}
}

// SetDoneTimeout bounds how long a worker that said it is done may take
// to exit before it is reported hung (HangDetector.SetDoneTimeout); 0,
// the default, leaves it unbounded. Call it before Run.
func (m *Monitor) SetDoneTimeout(t time.Duration) { m.det.SetDoneTimeout(t) }

// Forget stops watching a worker (it exited, or its group is being
// replaced): beats for its rank are dropped until a worker starts there
// again (Start, Expect), and its reports not yet taken are withdrawn.
// Once Run has returned it does nothing.
func (m *Monitor) Forget(rank int) {
	select {
	case m.forget <- rank:
	case <-m.ended:
	case <-m.closing:
	}
}

// Start says that a worker starts in local rank alone (a respawn): beats
// for the rank count again. Call it before the worker starts. Once Run
// has returned it does nothing.
func (m *Monitor) Start(rank int) {
	select {
	case m.start <- rank:
	case <-m.ended:
	case <-m.closing:
	}
}

// Expect says that the workers of local ranks were started together: the
// first beat of any of them starts watching the others (HangDetector.Expect),
// and beats for those ranks count again (see Forget). Once Run has
// returned it does nothing.
func (m *Monitor) Expect(ranks []int) {
	select {
	case m.expect <- ranks:
	case <-m.ended:
	case <-m.closing:
	}
}

// Close stops Run, closes the socket and removes its file.
func (m *Monitor) Close() error {
	var err error
	m.once.Do(func() {
		close(m.closing)
		err = m.conn.Close()
		os.Remove(m.path)
	})
	return err
}

// Beat sends one heartbeat for this worker: to the socket in
// GORUN_HEARTBEAT, as local rank LOCAL_RANK. Without GORUN_HEARTBEAT
// (heartbeats are off) it does nothing. Call it from the training loop —
// once a step — so that a step stuck in a collective stops the beats.
func Beat() error { return send("") }

// Done tells the agent that this worker's training is over: it is no
// longer watched, so that its teardown (closing its group, flushing,
// exiting), however long, is not taken for a hang. Call it only once
// training has succeeded: with --done-timeout a teardown the agent has to
// kill after Done counts as a success. Without GORUN_HEARTBEAT it does
// nothing.
func Done() error { return send(" done") }

// send sends this worker's beat with suffix.
func send(suffix string) error {
	conn, rank, err := dialBeats()
	if conn == nil {
		return err
	}
	defer conn.Close()
	if _, err := conn.Write([]byte(rank + suffix)); err != nil {
		return fmt.Errorf("heartbeat: %w", err)
	}
	return nil
}

// dialBeats connects to the agent's heartbeat socket: nil, nil without
// GORUN_HEARTBEAT. It also returns this worker's LOCAL_RANK.
func dialBeats() (*net.UnixConn, string, error) {
	path := os.Getenv(HeartbeatEnv)
	if path == "" {
		return nil, "", nil
	}
	rank := os.Getenv("LOCAL_RANK")
	if rank == "" {
		rank = "0"
	}
	conn, err := net.DialUnix("unixgram", nil, &net.UnixAddr{Name: path, Net: "unixgram"})
	if err != nil {
		return nil, "", fmt.Errorf("heartbeat: %w", err)
	}
	return conn, rank, nil
}

// waitInterval is how often Blocked beats: four beats a heartbeat timeout
// (GORUN_HEARTBEAT_TIMEOUT), within [10 ms, 1 s]; 250 ms when unset.
func waitInterval() time.Duration {
	s, err := strconv.ParseFloat(os.Getenv(HeartbeatTimeoutEnv), 64)
	if err != nil || s <= 0 {
		return 250 * time.Millisecond
	}
	return min(max(time.Duration(s*float64(time.Second))/4, 10*time.Millisecond), time.Second)
}

// Blocked tells the agent, until done is called, that this worker is alive
// and blocked on its peers: call it around a collective and around the
// wait for the agents' next epoch. The agent then does not take a peer's
// hang for this worker's (a rank that hangs stops every peer at its next
// collective); a worker blocked for BlockedFactor heartbeat timeouts is
// declared hung all the same. It beats from a goroutine of its own until
// done; without GORUN_HEARTBEAT it does nothing.
func Blocked() (done func()) {
	conn, rank, _ := dialBeats()
	if conn == nil {
		return func() {}
	}
	msg := []byte(rank + " wait")
	stop, finished := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(finished)
		defer conn.Close()
		t := time.NewTicker(waitInterval())
		defer t.Stop()
		for {
			conn.Write(msg) // a beat lost is the agent's to judge
			select {
			case <-stop:
				return
			case <-t.C:
			}
		}
	}()
	var once sync.Once
	return func() {
		once.Do(func() {
			close(stop)
			<-finished
		})
	}
}
