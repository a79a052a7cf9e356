package tcpstore

import (
	"errors"
	"sync"

	"go.uber.org/zap"

	"github.com/gorunhq/gorun/rendezvous"
)

// session is one client connection's protocol state, apart from how its
// bytes travel: the transport (an event loop, or a goroutine per
// connection) puts received bytes into dec, calls consume, and writes out
// what takeOutput hands it. Bytes queued by other goroutines — a released
// wait, a watch event — are announced through kick, which asks the
// transport to write them soon.
//
// Lock order: mu is never held while calling the Storage, because the
// Storage calls fire and event with its own lock held, and those take mu.
type session struct {
	srv    *Server
	remote string // for logs
	dec    decoder
	// kick asks the transport to write queued output. Called with no lock
	// held except possibly the Storage's, so it must not block.
	kick func()

	mu      sync.Mutex
	out     []byte // queued output, in order
	waits   []*pendingWait
	watches []Cancel
	dead    bool
}

func newSession(srv *Server, remote string) *session {
	return &session{srv: srv, remote: remote, dec: newDecoder(srv.lim, srv.table, srv.mem)}
}

type waitState uint8

const (
	wsPending waitState = iota
	wsFired
	wsCanceled
)

// pendingWait is one WAIT or BARRIER registered with the storage. Its state
// moves once, under session.mu, from pending to fired (STOP_WAITING queued)
// or to canceled (CANCEL_WAIT or disconnect), so a WAIT_CANCELED is never
// followed by a STOP_WAITING for the same wait.
type pendingWait struct {
	state  waitState
	cancel Cancel
}

func (s *session) logRemote() zap.Field { return zap.String("remote", s.remote) }

// consume executes every complete request in the decoder. A protocol or
// storage error means the connection must be closed (after writing what is
// queued: answers to the requests before the bad one).
func (s *session) consume() error {
	for {
		req, err := s.dec.next()
		if err == errIncomplete {
			return nil
		}
		if err == nil {
			s.srv.stats.requests.Add(1)
			err = s.handle(req)
		}
		if err != nil {
			s.srv.stats.rejected.Add(1)
			s.srv.log.Warn("closing store connection", s.logRemote(), zap.Error(err))
			return err
		}
	}
}

// takeOutput swaps the queued output for empty (a drained buffer the
// transport gives back for reuse) and returns it.
func (s *session) takeOutput(empty []byte) []byte {
	s.mu.Lock()
	out := s.out
	s.out = empty[:0]
	s.mu.Unlock()
	return out
}

// hasOutput reports whether output is queued.
func (s *session) hasOutput() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.out) > 0
}

// release withdraws every registration the session holds; the transport
// calls it once, when the connection closes.
func (s *session) release() {
	s.mu.Lock()
	s.dead = true
	waits, watches := s.waits, s.watches
	s.waits, s.watches = nil, nil
	for _, w := range waits {
		w.state = wsCanceled
	}
	s.mu.Unlock()
	for _, w := range waits {
		w.cancel()
	}
	for _, cancel := range watches {
		cancel()
	}
}

// queue appends response bytes built by fn.
func (s *session) queue(fn func([]byte) []byte) {
	s.mu.Lock()
	s.out = fn(s.out)
	s.mu.Unlock()
}

// fire is the storage's ready callback for w.
func (s *session) fire(w *pendingWait) {
	s.mu.Lock()
	if w.state != wsPending || s.dead {
		s.mu.Unlock()
		return
	}
	w.state = wsFired
	s.out = append(s.out, stopWaiting)
	s.dropWait(w)
	s.mu.Unlock()
	s.kick()
}

// dropWait removes w from s.waits; mu must be held.
func (s *session) dropWait(w *pendingWait) {
	for i, x := range s.waits {
		if x == w {
			s.waits = append(s.waits[:i], s.waits[i+1:]...)
			return
		}
	}
}

// wait registers a WAIT or BARRIER through register and answers it now or
// when the storage fires.
func (s *session) wait(register func(ready func()) (Cancel, bool, error)) error {
	w := &pendingWait{}
	cancel, done, err := register(func() { s.fire(w) })
	if err != nil {
		return err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	switch {
	case done:
		s.out = append(s.out, stopWaiting)
	case w.state == wsPending:
		w.cancel = cancel
		s.waits = append(s.waits, w)
	}
	// Otherwise it fired already and queued its own STOP_WAITING.
	return nil
}

// cancelWaits answers CANCEL_WAIT: every pending wait is withdrawn and
// exactly one WAIT_CANCELED is sent, whether or not anything was pending.
func (s *session) cancelWaits() { s.withdrawWaits(true) }

// abandonWaits withdraws the pending waits of a client that sent a new
// request without CANCEL_WAIT. Every c10d client is synchronous (one
// request in flight per connection), so a new request while a WAIT is
// unanswered means the client gave the WAIT up: PyTorch 1.13 times a wait
// out on the socket alone and sends nothing. Answering the abandoned WAIT
// later would put a stray STOP_WAITING in front of the next reply and
// desynchronise the client, so it is withdrawn without a word.
func (s *session) abandonWaits() {
	s.mu.Lock()
	n := len(s.waits)
	s.mu.Unlock()
	if n > 0 {
		s.srv.stats.abandoned.Add(int64(n))
		s.withdrawWaits(false)
	}
}

// withdrawWaits cancels every pending wait and, when answer is set, queues
// one WAIT_CANCELED.
func (s *session) withdrawWaits(answer bool) {
	s.mu.Lock()
	waits := s.waits
	s.waits = nil
	for _, w := range waits {
		w.state = wsCanceled
	}
	if answer {
		s.out = append(s.out, waitCanceled)
	}
	s.mu.Unlock()
	for _, w := range waits {
		w.cancel()
	}
}

// event is the storage's watch callback for the old generation's WATCH_KEY.
func (s *session) event(ev WatchEvent) {
	s.mu.Lock()
	if s.dead {
		s.mu.Unlock()
		return
	}
	s.out = append(s.out, byte(ev.Type))
	s.out = appendBytes(s.out, ev.Key)
	s.out = appendBytes(s.out, ev.Old)
	s.out = appendBytes(s.out, ev.New)
	s.mu.Unlock()
	s.kick()
}

// handle executes one request and queues its answer. An error closes the
// connection.
func (s *session) handle(req *request) error {
	st := s.srv.storage
	if req.op != OpCancelWait {
		s.abandonWaits()
	}
	switch req.op {
	case OpValidate:
		// The decoder accepts it only as the first request.
	case OpPing:
		s.queue(func(b []byte) []byte { return appendU32(b, req.u32) })
	case OpSet:
		return st.Set(req.key, req.val)
	case OpGet:
		// c10d clients WAIT before GET, so a missing key means it was
		// deleted in between; answer empty as the libuv backend does.
		v, _, err := st.Get(req.key)
		if err != nil {
			return err
		}
		s.queue(func(b []byte) []byte { return appendBytes(b, v) })
	case OpCompareSet:
		v, err := st.CompareSet(req.key, req.val, req.val2)
		if err != nil {
			return err
		}
		s.queue(func(b []byte) []byte { return appendBytes(b, v) })
	case OpAdd:
		n, err := st.Add(req.key, req.n)
		if err != nil {
			if errors.Is(err, rendezvous.ErrNotInteger) {
				return protocolErrorf("ADD %q: %v", req.key, err)
			}
			return err
		}
		s.queue(func(b []byte) []byte { return appendI64(b, n) })
	case OpCheck:
		ok, err := st.Check(req.keys)
		if err != nil {
			return err
		}
		r := checkNotReady
		if ok {
			r = checkReady
		}
		s.queue(func(b []byte) []byte { return append(b, r) })
	case OpWait:
		return s.wait(func(ready func()) (Cancel, bool, error) { return st.Wait(req.keys, ready) })
	case OpBarrier:
		return s.wait(func(ready func()) (Cancel, bool, error) { return st.Barrier(req.key, req.n, ready) })
	case OpCancelWait:
		s.cancelWaits()
	case OpNumKeys:
		n, err := st.NumKeys()
		if err != nil {
			return err
		}
		s.queue(func(b []byte) []byte { return appendI64(b, n) })
	case OpDelete:
		ok, err := st.Delete(req.key)
		if err != nil {
			return err
		}
		var n int64
		if ok {
			n = 1
		}
		s.queue(func(b []byte) []byte { return appendI64(b, n) })
	case OpAppend:
		return st.Append(req.key, req.val)
	case OpMultiGet:
		vals := make([][]byte, len(req.keys))
		for i, k := range req.keys {
			v, _, err := st.Get(k)
			if err != nil {
				return err
			}
			vals[i] = v
		}
		s.queue(func(b []byte) []byte {
			for _, v := range vals {
				b = appendBytes(b, v)
			}
			return b
		})
	case OpMultiSet:
		for i, k := range req.keys {
			if err := st.Set(k, req.vals[i]); err != nil {
				return err
			}
		}
	case OpListKeys:
		keys, err := st.Keys()
		if err != nil {
			return err
		}
		s.queue(func(b []byte) []byte {
			b = appendI64(b, int64(len(keys)))
			for _, k := range keys {
				b = appendBytes(b, k)
			}
			return b
		})
	case OpQueuePush:
		return st.QueuePush(req.key, req.val)
	case OpQueuePop:
		v, n, err := st.QueuePop(req.key)
		if err != nil {
			return err
		}
		s.queue(func(b []byte) []byte {
			b = appendI64(b, n)
			if n > 0 {
				b = appendBytes(b, v)
			}
			return b
		})
	case OpQueueLen:
		n, err := st.QueueLen(req.key)
		if err != nil {
			return err
		}
		s.queue(func(b []byte) []byte { return appendI64(b, n) })
	case OpWatchKey:
		// The registration answer goes out before any event.
		s.queue(func(b []byte) []byte { return append(b, watchKeyRegistered) })
		cancel, err := st.Watch(req.key, s.event)
		if err != nil {
			return err
		}
		s.mu.Lock()
		s.watches = append(s.watches, cancel)
		s.mu.Unlock()
	default:
		return protocolErrorf("unhandled opcode %v", req.op)
	}
	return nil
}
