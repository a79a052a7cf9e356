//go:build !linux

package tcpstore

import (
	"errors"
	"net"
)

// Without epoll every connection gets a goroutine (transport_conn.go).

type eventLoop struct{}

func (*eventLoop) add(int, string) {}
func (*eventLoop) stop()           {}

func dupConn(net.Conn) (int, bool) { return -1, false }

func startLoops(*Server, int) ([]*eventLoop, error) {
	return nil, errors.New("event loops need epoll (Linux)")
}
