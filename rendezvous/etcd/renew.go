package etcd

import (
	"context"
	"errors"
	"fmt"
	"time"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"
)

// leaseRenewer renews a lease one request at a time on one LeaseKeepAlive
// stream, kept open from one renewal to the next and through late
// answers. clientv3's KeepAliveOnce opens a gRPC stream for each renewal
// and closes it: at 1,024 agents that was 820 streams opened a second,
// etcd's gRPC writer a quarter of its CPU (BENCHMARKS.md, issue 19). Its
// KeepAlive keeps one stream but renews on a 500 ms tick, half of a 1 s
// TTL, and takes a slow answer for a lost lease.
//
// A request whose answer is late stays outstanding: the renewal after it
// sends nothing and waits for that answer, which renews the lease as well
// as a new request would. A renewer that gave up the stream instead (as
// the first one did) opened a stream per late answer, more work for an
// etcd too slow already. The stream is given up only when it fails, or
// when its request has had no answer for as long as the lease lives.
// etcd itself ends it while its apply lags: a renewal waits for the apply
// to catch up, and fails after a second ("waiting for the applied index
// took too long"), which made 57,513 of the 57,639 streams given up in a
// 1,024-agent start (BENCHMARKS.md, issue 19, session 4).
//
// A renewer is used by one goroutine.
type leaseRenewer struct {
	ctx    context.Context // bounds the stream: the node's liveness
	leases pb.LeaseClient
	log    *zap.Logger

	stream  pb.Lease_LeaseKeepAliveClient
	cancel  context.CancelFunc // ends stream and its receiver
	answers <-chan renewAnswer // stream's answers, in the order of its requests
	sent    time.Time          // when the outstanding request was sent; zero when none is
	sentID  clientv3.LeaseID   // the outstanding request's lease
}

// renewAnswer is one answer on the stream, or the error that ended it.
type renewAnswer struct {
	resp *pb.LeaseKeepAliveResponse
	err  error
}

func newLeaseRenewer(ctx context.Context, cli *clientv3.Client, log *zap.Logger) *leaseRenewer {
	return &leaseRenewer{ctx: ctx, leases: pb.NewLeaseClient(cli.ActiveConnection()), log: log}
}

// errNoAnswer is renew's error when etcd has not answered within the
// timeout: the request stays outstanding, its answer may come yet.
var errNoAnswer = errors.New("no answer yet")

// renew renews lease id, which lives for ttl, and returns the TTL etcd
// answered (0 when etcd knows no such lease: it expired, or was revoked)
// and when the request answered was sent: the lease was renewed then or
// later, so the next renewal is due from then. It waits at most timeout
// for the answer.
func (r *leaseRenewer) renew(id clientv3.LeaseID, ttl, timeout time.Duration) (int64, time.Time, error) {
	if r.stream != nil && !r.sent.IsZero() && (r.sentID != id || time.Since(r.sent) >= ttl) {
		// Outstanding for another lease (the node registered again), or
		// for as long as a lease lives: whatever comes on this stream is
		// of no use now.
		r.close("its request is stale", nil)
	}
	if r.stream == nil {
		if err := r.open(timeout); err != nil {
			return 0, time.Time{}, err
		}
	}
	if r.sent.IsZero() {
		if err := r.stream.Send(&pb.LeaseKeepAliveRequest{ID: int64(id)}); err != nil {
			r.close("the request was not sent", err)
			return 0, time.Time{}, fmt.Errorf("etcd lease keep-alive of %x: %w", int64(id), rpctypes.Error(err))
		}
		r.sent, r.sentID = time.Now(), id
	}
	late := time.NewTimer(timeout)
	defer late.Stop()
	select {
	case a := <-r.answers:
		sent := r.sent
		r.sent = time.Time{}
		err := a.err
		if err == nil && a.resp.ID != int64(id) {
			err = fmt.Errorf("asked for lease %x, answered for %x", int64(id), a.resp.ID)
		}
		if err != nil {
			r.close("it failed", err)
			return 0, time.Time{}, fmt.Errorf("etcd lease keep-alive of %x: %w", int64(id), rpctypes.Error(err))
		}
		return a.resp.TTL, sent, nil
	case <-late.C:
		return 0, time.Time{}, fmt.Errorf("etcd lease keep-alive of %x: %w (sent %v ago)", int64(id), errNoAnswer,
			time.Since(r.sent).Round(time.Millisecond))
	case <-r.ctx.Done():
		// Closed: not a third of a TTL later (with a start lease of a
		// big job, StartTTL/3 is many seconds).
		return 0, time.Time{}, fmt.Errorf("etcd lease keep-alive of %x: %w", int64(id), r.ctx.Err())
	}
}

// open opens the stream and starts its receiver, which hands each answer
// to renew until the stream ends.
func (r *leaseRenewer) open(timeout time.Duration) error {
	ctx, cancel := context.WithCancel(r.ctx)
	opening := time.AfterFunc(timeout, cancel)
	s, err := r.leases.LeaseKeepAlive(ctx)
	if !opening.Stop() && err == nil {
		err = fmt.Errorf("no stream in %v: %w", timeout, context.DeadlineExceeded)
	}
	if err != nil {
		cancel()
		r.log.Debug("etcd lease keep-alive stream not opened", zap.Error(err))
		return fmt.Errorf("etcd lease keep-alive stream: %w", rpctypes.Error(err))
	}
	answers := make(chan renewAnswer)
	go func() {
		for {
			resp, err := s.Recv()
			if ctx.Err() != nil {
				return // given up or closed: nobody waits for it
			}
			select {
			case answers <- renewAnswer{resp, err}:
			case <-ctx.Done():
				return
			}
			if err != nil {
				return
			}
		}
	}()
	r.stream, r.cancel, r.answers, r.sent = s, cancel, answers, time.Time{}
	return nil
}

// close ends the stream and its receiver, if a stream is open, and says
// why (a stream given up under load is work for etcd: see leaseRenewer).
func (r *leaseRenewer) close(why string, err error) {
	if r.stream != nil {
		if err != nil || why != "" {
			r.log.Debug("etcd lease keep-alive stream given up: "+why, zap.Error(err))
		}
		r.cancel()
		r.stream, r.cancel, r.answers, r.sent = nil, nil, nil, time.Time{}
	}
}
