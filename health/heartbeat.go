package health

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"strconv"
	"strings"
	"sync"
	"time"
)

// HeartbeatEnv names the variable that tells a worker where to send its
// heartbeats: the path of the agent's unix datagram socket.
const HeartbeatEnv = "GORUN_HEARTBEAT"

// A heartbeat is one datagram whose payload starts with the worker's local
// rank in decimal; anything after the first space is ignored. In Python:
//
//	s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
//	s.sendto(os.environ["LOCAL_RANK"].encode(), os.environ["GORUN_HEARTBEAT"])
func parseBeat(b []byte) (int, error) {
	s, _, _ := strings.Cut(strings.TrimSpace(string(b)), " ")
	rank, err := strconv.Atoi(s)
	if err != nil || rank < 0 {
		return 0, fmt.Errorf("heartbeat %q: want a local rank", b)
	}
	return rank, nil
}

// Monitor receives heartbeats on a unix datagram socket and reports workers
// whose heartbeats stop. It is the I/O around a HangDetector.
type Monitor struct {
	conn    *net.UnixConn
	path    string
	det     *HangDetector
	forget  chan int
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
		forget: make(chan int), closing: make(chan struct{}),
	}, nil
}

// Path is the socket's path, the value of GORUN_HEARTBEAT for workers.
func (m *Monitor) Path() string { return m.path }

type beat struct {
	rank int
	at   time.Time
}

// Run reads heartbeats and sends an Event on events for every worker that
// stops beating, until ctx is done or the Monitor is closed. Malformed
// datagrams are ignored.
func (m *Monitor) Run(ctx context.Context, events chan<- Event) error {
	beats := make(chan beat, 64)
	readErr := make(chan error, 1)
	go func() { readErr <- m.read(beats) }()

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
		case b := <-beats:
			m.det.Beat(b.rank, b.at)
			rearm()
		case rank := <-m.forget:
			m.det.Forget(rank)
			rearm()
		case now := <-timer.C:
			for _, ev := range m.det.Expired(now) {
				select {
				case events <- ev:
				case <-ctx.Done():
				case <-m.closing:
				}
			}
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
		rank, err := parseBeat(buf[:n])
		if err != nil {
			continue
		}
		select {
		case beats <- beat{rank, time.Now()}:
		case <-m.closing:
			return nil
		}
	}
}

// Forget stops watching a worker (it exited, or its group is being
// replaced). It must be called while Run runs.
func (m *Monitor) Forget(rank int) {
	select {
	case m.forget <- rank:
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
func Beat() error {
	path := os.Getenv(HeartbeatEnv)
	if path == "" {
		return nil
	}
	rank := os.Getenv("LOCAL_RANK")
	if rank == "" {
		rank = "0"
	}
	conn, err := net.DialUnix("unixgram", nil, &net.UnixAddr{Name: path, Net: "unixgram"})
	if err != nil {
		return fmt.Errorf("heartbeat: %w", err)
	}
	defer conn.Close()
	if _, err := conn.Write([]byte(rank)); err != nil {
		return fmt.Errorf("heartbeat: %w", err)
	}
	return nil
}
