// Package tcpstore speaks c10d's TCPStore wire protocol: a server that
// unmodified PyTorch workers use as their store, and a client that talks to
// PyTorch's own server or to ours.
//
// Two wire generations exist (see ../shared/spec/c10d-wire.md):
//
//   - the old one, PyTorch 1.13 through 2.0: no handshake, opcodes SET=0 …
//     DELETE_KEY=8, and WATCH_KEY callbacks on a second socket;
//   - the new one (the "VALIDATE era", 2.1+): VALIDATE with a magic number
//     and PING first, then opcodes VALIDATE=0 … BARRIER=18.
//
// Framing is the same in both: a one-byte opcode, then fields; strings are a
// little-endian u64 length and the bytes; there is no message length. The
// server tells the generations apart per connection from the first bytes.
package tcpstore

import (
	"encoding/binary"
	"fmt"
)

// Op is a request type, independent of the wire generation. Its numeric value
// is the new generation's opcode.
type Op uint8

// New-generation opcodes (TCPStoreBackend.hpp QueryType), plus opWatchKey,
// which only the old generation has.
const (
	OpValidate   Op = 0
	OpSet        Op = 1
	OpCompareSet Op = 2
	OpGet        Op = 3
	OpAdd        Op = 4
	OpCheck      Op = 5
	OpWait       Op = 6
	OpNumKeys    Op = 7
	OpDelete     Op = 8
	OpAppend     Op = 9
	OpMultiGet   Op = 10
	OpMultiSet   Op = 11
	OpCancelWait Op = 12
	OpPing       Op = 13
	OpQueuePush  Op = 14
	OpQueuePop   Op = 15
	OpQueueLen   Op = 16
	OpListKeys   Op = 17
	OpBarrier    Op = 18
	// OpWatchKey is old-generation only (opcode 7 there); it has no
	// new-generation opcode.
	OpWatchKey Op = 0xff
)

var opNames = map[Op]string{
	OpValidate: "VALIDATE", OpSet: "SET", OpCompareSet: "COMPARE_SET", OpGet: "GET",
	OpAdd: "ADD", OpCheck: "CHECK", OpWait: "WAIT", OpNumKeys: "GETNUMKEYS",
	OpDelete: "DELETE_KEY", OpAppend: "APPEND", OpMultiGet: "MULTI_GET",
	OpMultiSet: "MULTI_SET", OpCancelWait: "CANCEL_WAIT", OpPing: "PING",
	OpQueuePush: "QUEUE_PUSH", OpQueuePop: "QUEUE_POP", OpQueueLen: "QUEUE_LEN",
	OpListKeys: "LIST_KEYS", OpBarrier: "BARRIER", OpWatchKey: "WATCH_KEY",
}

func (o Op) String() string {
	if n, ok := opNames[o]; ok {
		return n
	}
	return fmt.Sprintf("Op(%d)", uint8(o))
}

// Generation is a wire generation.
type Generation uint8

const (
	// GenNew is the VALIDATE era: PyTorch 2.1 and later.
	GenNew Generation = iota
	// GenOld is PyTorch 1.13 through 2.0.
	GenOld
)

func (g Generation) String() string {
	switch g {
	case GenNew:
		return "new"
	case GenOld:
		return "old"
	}
	return fmt.Sprintf("Generation(%d)", uint8(g))
}

// ParseGeneration reads "new" or "old" (as in `--wire`).
func ParseGeneration(s string) (Generation, error) {
	switch s {
	case "new", "":
		return GenNew, nil
	case "old", "1.13":
		return GenOld, nil
	}
	return 0, fmt.Errorf("unknown wire generation %q (want new or old)", s)
}

// LegacyTable selects how opcodes are read on a connection that did not open
// with VALIDATE.
type LegacyTable uint8

const (
	// Legacy113 is PyTorch 1.13–2.0: SET=0 COMPARE_SET=1 GET=2 ADD=3
	// CHECK=4 WAIT=5 GETNUMKEYS=6 WATCH_KEY=7 DELETE_KEY=8. The default.
	Legacy113 LegacyTable = iota
	// Legacy21 is a release between #105014 (WATCH_KEY removed) and #107607
	// (VALIDATE added), if one shipped: SET=0 … GETNUMKEYS=6 DELETE_KEY=7
	// APPEND=8 MULTI_GET=9 MULTI_SET=10 CANCEL_WAIT=11. Derived from the
	// sources, never observed on the wire.
	Legacy21
)

// oldOpcodes maps an old-generation opcode byte to an Op; entries absent
// from a table are unknown opcodes there.
var oldOpcodes = map[LegacyTable][]Op{
	Legacy113: {OpSet, OpCompareSet, OpGet, OpAdd, OpCheck, OpWait, OpNumKeys, OpWatchKey, OpDelete},
	Legacy21:  {OpSet, OpCompareSet, OpGet, OpAdd, OpCheck, OpWait, OpNumKeys, OpDelete, OpAppend, OpMultiGet, OpMultiSet, OpCancelWait},
}

// opcode returns the byte that carries op in generation g (old-generation
// requests use Legacy113), and false if g has no such op.
func opcode(g Generation, op Op) (byte, bool) {
	if g == GenNew {
		return byte(op), op <= OpBarrier
	}
	for b, o := range oldOpcodes[Legacy113] {
		if o == op {
			return byte(b), true
		}
	}
	return 0, false
}

// Protocol constants.
const (
	// ValidationMagic follows VALIDATE (u32 LE; bytes CE F7 85 3C).
	ValidationMagic uint32 = 0x3C85F7CE

	checkReady    byte = 0 // CheckResponseType::READY
	checkNotReady byte = 1 // CheckResponseType::NOT_READY
	stopWaiting   byte = 0 // WaitResponseType::STOP_WAITING
	waitCanceled  byte = 1 // WaitResponseType::WAIT_CANCELED

	// Old-generation WATCH_KEY responses and callbacks (WatchResponseType).
	watchKeyUpdated    byte = 0
	watchKeyCreated    byte = 1
	watchKeyDeleted    byte = 2
	watchKeyRegistered byte = 3

	// KeyPrefix is what c10d's TCPStore client puts before every user key.
	KeyPrefix = "/"
	// InitKey counts the clients of a store created with a world size; it is
	// sent without KeyPrefix.
	InitKey = "init/"
)

// Limits bound what one request may carry. Exceeding one closes that
// connection (a c10d server's only way to refuse).
//
// The defaults accept whatever PyTorch's own servers store in practice:
// 1.13's has no limits at all, and clients set values of hundreds of MB and
// keys of 100 KB and more. Memory stays bounded regardless: a length prefix
// allocates nothing; buffers grow only as the bytes arrive, and
// ServerConfig.MaxBuffered caps what every connection together may hold in
// requests still arriving.
type Limits struct {
	// MaxKeySize bounds every string that is not a value (keys). Default
	// 64 MiB.
	MaxKeySize int
	// MaxValueSize bounds a value (SET, APPEND, COMPARE_SET's expected and
	// desired, MULTI_SET, QUEUE_PUSH). Default 1 GiB.
	MaxValueSize int
	// MaxKeyCount bounds the number of keys in CHECK, WAIT, MULTI_GET and
	// MULTI_SET. Default 131072 (the libuv backend's).
	MaxKeyCount int
	// MaxRequestSize bounds one request as a whole. It is raised to at
	// least two values and a key (a COMPARE_SET). Default 2 GiB + 64 MiB +
	// 64 bytes, that minimum for the default sizes.
	MaxRequestSize int
}

// Default limits; see Limits.
const (
	DefaultMaxKeySize   = 64 << 20
	DefaultMaxValueSize = 1 << 30
	DefaultMaxKeyCount  = 128 << 10
)

// DefaultLimits returns the default Limits.
func DefaultLimits() Limits {
	return Limits{
		MaxKeySize:     DefaultMaxKeySize,
		MaxValueSize:   DefaultMaxValueSize,
		MaxKeyCount:    DefaultMaxKeyCount,
		MaxRequestSize: minRequestSize(DefaultMaxKeySize, DefaultMaxValueSize),
	}
}

// minRequestSize is the smallest request limit that holds a COMPARE_SET of
// the largest key and two of the largest values, with its lengths.
func minRequestSize(maxKey, maxValue int) int { return maxValue*2 + maxKey + 64 }

func (l Limits) withDefaults() Limits {
	d := DefaultLimits()
	if l.MaxKeySize <= 0 {
		l.MaxKeySize = d.MaxKeySize
	}
	if l.MaxValueSize <= 0 {
		l.MaxValueSize = d.MaxValueSize
	}
	if l.MaxKeyCount <= 0 {
		l.MaxKeyCount = d.MaxKeyCount
	}
	// A request must be able to hold its largest value.
	l.MaxRequestSize = max(l.MaxRequestSize, minRequestSize(l.MaxKeySize, l.MaxValueSize))
	return l
}

// Encoding helpers. They append to b and return it, so a request or a
// response is built in one buffer and written with one call.

func appendU8(b []byte, v byte) []byte { return append(b, v) }

func appendU32(b []byte, v uint32) []byte { return binary.LittleEndian.AppendUint32(b, v) }

func appendU64(b []byte, v uint64) []byte { return binary.LittleEndian.AppendUint64(b, v) }

func appendI64(b []byte, v int64) []byte { return binary.LittleEndian.AppendUint64(b, uint64(v)) }

func appendBytes(b, s []byte) []byte {
	b = appendU64(b, uint64(len(s)))
	return append(b, s...)
}

func appendString(b []byte, s string) []byte {
	b = appendU64(b, uint64(len(s)))
	return append(b, s...)
}
