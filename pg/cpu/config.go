package cpu

import (
	"errors"
	"fmt"
	"net"
	"os"

	"github.com/gorunhq/gorun/pg"
)

// Config configures a Group. Start from DefaultConfig and set Bootstrap; a
// zero field other than the Bootstrap's takes its documented default.
type Config struct {
	// Bootstrap says where ranks meet (Store, Namespace), who this rank is
	// (Rank, Size) and how long forming the group and each operation may
	// take (Timeout, default pg.DefaultTimeout). Required.
	pg.Bootstrap

	// ListenAddr is the "host:port" this rank listens on for its peers'
	// connections while the group forms (the listener is closed once every
	// peer has connected). Port 0 picks a free port. Default ":0": every
	// interface, any port.
	ListenAddr string

	// AdvertiseHost is the host (name or address) peers dial, published in
	// the store with the listener's port. Default: ListenAddr's host when it
	// names one; otherwise the first non-loopback address this machine's
	// hostname resolves to; otherwise the first non-loopback address of an
	// interface that is up; otherwise 127.0.0.1.
	AdvertiseHost string

	// SmallBytes: collectives on buffers of at most this many bytes use the
	// latency-optimal algorithm (every rank sends its data straight to every
	// rank that needs it: one message hop, N-1 messages per rank, the
	// reduction done in rank order on every rank); larger ones use the ring
	// (reduce-scatter then all-gather, pipelined in chunks of ChunkBytes),
	// which moves 2(N-1)/N of the buffer per rank. Default
	// DefaultSmallBytes. Negative: always the ring (for tests).
	SmallBytes int

	// ChunkBytes is the pipelining unit of the ring and of the broadcast
	// chain: a rank forwards a chunk as soon as it has reduced it. Smaller
	// chunks overlap more and cost more system calls. Default
	// DefaultChunkBytes; rounded down to whole elements, at least one.
	ChunkBytes int

	// SocketBufferBytes sets SO_SNDBUF and SO_RCVBUF on the data
	// connections. Default 0: the kernel's defaults, with its autotuning.
	SocketBufferBytes int

	// LocalTransport is how two ranks on the same host connect:
	//   - TransportShm (the default): an abstract unix socket, with each
	//     direction's bytes in a ring of shared-memory slots (ShmSlots
	//     slots of ChunkBytes, at least a page each, per direction and
	//     pair) that both ranks map and the socket as the doorbell. A
	//     socket copies every byte twice (into the kernel and out of it);
	//     the ring once, and the ring's reduce-scatter reduces straight
	//     from the peer's slot: on 4 ranks of a 2-core machine it moves
	//     1.6–1.9× what unix sockets do from 1 MiB up. Messages of at most
	//     SmallBytes travel on the socket all the same. A pair uses shared
	//     memory only when both ranks ask for it and can create memfds;
	//     otherwise it falls back to TransportUnix;
	//   - TransportUnix: the abstract unix socket alone, which moves about
	//     twice what loopback TCP does (it skips the TCP/IP stack);
	//   - TransportTCP: loopback TCP, as between hosts.
	// "The same host" means the same kernel boot and the same network
	// namespace — where an abstract socket is reachable — so ranks in
	// different network namespaces (containers, the multi-host test bed)
	// always use TCP. Ranks on different hosts always use TCP.
	LocalTransport string
}

// Local transports (Config.LocalTransport).
const (
	TransportUnix = "unix"
	TransportShm  = "shm"
	TransportTCP  = "tcp"
)

// ShmSlots is the number of slots in each shared-memory ring
// (TransportShm): how many chunks a sender may be ahead of its receiver.
const ShmSlots = 4

// Defaults of the Config fields.
const (
	DefaultListenAddr = ":0"
	DefaultSmallBytes = 64 << 10
	DefaultChunkBytes = 512 << 10
)

// DefaultConfig returns a Config with every default filled in and an empty
// Bootstrap.
func DefaultConfig() Config {
	return Config{
		ListenAddr:     DefaultListenAddr,
		SmallBytes:     DefaultSmallBytes,
		ChunkBytes:     DefaultChunkBytes,
		LocalTransport: TransportShm,
	}
}

func (c Config) withDefaults() Config {
	if c.ListenAddr == "" {
		c.ListenAddr = DefaultListenAddr
	}
	if c.SmallBytes == 0 {
		c.SmallBytes = DefaultSmallBytes
	}
	if c.ChunkBytes <= 0 {
		c.ChunkBytes = DefaultChunkBytes
	}
	if c.LocalTransport == "" {
		c.LocalTransport = TransportShm
	}
	return c
}

func (c Config) validate() error {
	if err := c.Bootstrap.Validate(); err != nil {
		return err
	}
	if _, _, err := net.SplitHostPort(c.ListenAddr); err != nil {
		return fmt.Errorf("%w: listen address %q: %w", pg.ErrInvalidArgument, c.ListenAddr, err)
	}
	if c.SocketBufferBytes < 0 {
		return fmt.Errorf("%w: negative socket buffer size %d", pg.ErrInvalidArgument, c.SocketBufferBytes)
	}
	switch c.LocalTransport {
	case TransportUnix, TransportShm, TransportTCP:
	default:
		return fmt.Errorf("%w: local transport %q (want %q, %q or %q)", pg.ErrInvalidArgument, c.LocalTransport, TransportUnix, TransportShm, TransportTCP)
	}
	return nil
}

// advertiseHost picks the host peers dial, as Config.AdvertiseHost says.
func (c Config) advertiseHost() string {
	if c.AdvertiseHost != "" {
		return c.AdvertiseHost
	}
	host, _, _ := net.SplitHostPort(c.ListenAddr)
	if ip := net.ParseIP(host); host != "" && (ip == nil || !ip.IsUnspecified()) {
		return host
	}
	if name, err := os.Hostname(); err == nil {
		if ips, err := net.LookupIP(name); err == nil {
			for _, ip := range ips {
				if !ip.IsLoopback() && ip.To4() != nil {
					return ip.String()
				}
			}
		}
	}
	if addrs, err := net.InterfaceAddrs(); err == nil {
		for _, a := range addrs {
			if n, ok := a.(*net.IPNet); ok && n.IP.IsGlobalUnicast() && n.IP.To4() != nil {
				return n.IP.String()
			}
		}
	}
	return "127.0.0.1"
}

// checkDType rejects the dtypes pg/cpu has no arithmetic for.
func checkDType(d pg.DType) error {
	switch d {
	case pg.Float32, pg.Float64, pg.Int32, pg.Int64:
		return nil
	case pg.Float16, pg.BFloat16:
		return fmt.Errorf("%w: %v not supported", pg.ErrInvalidArgument, d)
	}
	return fmt.Errorf("%w: unknown dtype %v", pg.ErrInvalidArgument, d)
}

var errStopped = errors.New("group stopped")
