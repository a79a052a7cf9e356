package tcpstore

import (
	"errors"
	"fmt"
	"sync/atomic"
)

// DefaultMaxBuffered is ServerConfig.MaxBuffered's default: 2 GiB, room for
// a few requests of hundreds of MB at once.
const DefaultMaxBuffered int64 = 2 << 30

// ErrBufferFull: a request's bytes would take the memory that all
// connections hold in requests still arriving past
// ServerConfig.MaxBuffered. The server closes that connection (c10d's
// protocol has no error reply) and counts it in Stats.BufferFull; other
// connections go on.
var ErrBufferFull = errors.New("tcpstore: the server's buffer for requests in flight is full")

// budget is the server-wide account of the bytes that connections' read
// buffers hold. A nil budget is unlimited and keeps no account.
type budget struct {
	limit int64
	used  atomic.Int64
}

func newBudget(limit int64) *budget { return &budget{limit: limit} }

// reserve takes n bytes from the budget, or fails with ErrBufferFull and
// takes nothing.
func (b *budget) reserve(n int) error {
	if b == nil || n <= 0 {
		return nil
	}
	for {
		u := b.used.Load()
		if u+int64(n) > b.limit {
			return fmt.Errorf("%w: %d more bytes for one connection, %d of %d held already "+
				"(ServerConfig.MaxBuffered; gorun store serve --max-buffered)", ErrBufferFull, n, u, b.limit)
		}
		if b.used.CompareAndSwap(u, u+int64(n)) {
			return nil
		}
	}
}

// free gives n bytes back.
func (b *budget) free(n int) {
	if b != nil && n > 0 {
		b.used.Add(-int64(n))
	}
}

// held returns the bytes reserved now.
func (b *budget) held() int64 {
	if b == nil {
		return 0
	}
	return b.used.Load()
}
