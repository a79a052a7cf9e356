package etcd

import (
	"context"
	"fmt"
	"time"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// leaseRenewer renews a lease one request at a time on one LeaseKeepAlive
// stream, kept open from one renewal to the next. clientv3's
// KeepAliveOnce opens a gRPC stream for each renewal and closes it: at
// 1,024 agents that was 820 streams opened a second, etcd's gRPC writer a
// quarter of its CPU (BENCHMARKS.md, issue 19). Its KeepAlive keeps one
// stream but renews on a 500 ms tick, half of a 1 s TTL, and takes a slow
// answer for a lost lease. A renewer is used by one goroutine.
type leaseRenewer struct {
	ctx    context.Context // bounds the stream: the node's liveness
	leases pb.LeaseClient

	stream pb.Lease_LeaseKeepAliveClient
	cancel context.CancelFunc // ends stream
}

func newLeaseRenewer(ctx context.Context, cli *clientv3.Client) *leaseRenewer {
	return &leaseRenewer{ctx: ctx, leases: pb.NewLeaseClient(cli.ActiveConnection())}
}

// renew renews lease id and returns the TTL etcd answered: 0 when etcd
// knows no such lease (it expired, or was revoked). An answer that does
// not come within timeout ends the stream (the next renewal opens
// another): on a stream an answer late is an answer to the wrong request.
func (r *leaseRenewer) renew(id clientv3.LeaseID, timeout time.Duration) (int64, error) {
	if r.stream == nil {
		ctx, cancel := context.WithCancel(r.ctx)
		opening := time.AfterFunc(timeout, cancel)
		s, err := r.leases.LeaseKeepAlive(ctx)
		opening.Stop()
		if err != nil {
			cancel()
			return 0, fmt.Errorf("etcd lease keep-alive stream: %w", rpctypes.Error(err))
		}
		r.stream, r.cancel = s, cancel
	}
	late := time.AfterFunc(timeout, r.cancel)
	err := r.stream.Send(&pb.LeaseKeepAliveRequest{ID: int64(id)})
	var resp *pb.LeaseKeepAliveResponse
	if err == nil {
		resp, err = r.stream.Recv()
	}
	if !late.Stop() {
		// The stream was ended for want of an answer (Recv's error is
		// then only "canceled"), or as one came.
		err = fmt.Errorf("no answer in %v: %w", timeout, context.DeadlineExceeded)
	}
	if err == nil && resp.ID != int64(id) {
		err = fmt.Errorf("etcd lease keep-alive: asked for lease %x, answered for %x", int64(id), resp.ID)
	}
	if err != nil {
		r.close()
		return 0, fmt.Errorf("etcd lease keep-alive of %x: %w", int64(id), rpctypes.Error(err))
	}
	return resp.TTL, nil
}

// close ends the stream, if one is open.
func (r *leaseRenewer) close() {
	if r.stream != nil {
		r.cancel()
		r.stream, r.cancel = nil, nil
	}
}
