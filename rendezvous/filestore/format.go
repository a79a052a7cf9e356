package filestore

import (
	"bufio"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"math"
	"os"
	"strings"

	"github.com/gorunhq/gorun/rendezvous"
)

// The key namespace inside the file (spec/c10d-wire.md §3.1). User keys carry
// a "/" prefix, so c10d's internal counters, which have none, never collide
// with them, and a user key starting with "-" never reads as a tombstone.
const (
	userPrefix      = "/"         // user key k is stored as "/"+k
	tombstonePrefix = "-"         // a record key "-"+x deletes x; delete writes "-/"+k
	cleanupKey      = "cleanup/"  // how many stores have closed (both generations)
	refcountKey     = "refcount/" // how many stores are open (newest PyTorch only)
)

// ErrCorrupt reports a file that does not parse as c10d's record log: a
// record running past the end of the file, typically left by a writer that
// died mid-write.
var ErrCorrupt = errors.New("corrupt store file")

func userKey(k string) string { return userPrefix + k }

// record is one entry of the log: u32 LE key length, key, u32 LE value
// length, value. There is no header, and the log is never compacted.
type record struct{ key, value string }

// appendRecord appends r's encoding to buf.
func appendRecord(buf []byte, r record) ([]byte, error) {
	if uint64(len(r.key)) > math.MaxUint32 || uint64(len(r.value)) > math.MaxUint32 {
		return buf, fmt.Errorf("%w: record longer than 4 GiB", rendezvous.ErrInvalidArgument)
	}
	buf = binary.LittleEndian.AppendUint32(buf, uint32(len(r.key)))
	buf = append(buf, r.key...)
	buf = binary.LittleEndian.AppendUint32(buf, uint32(len(r.value)))
	return append(buf, r.value...), nil
}

// table is the key map replayed from the file, the offset replayed up to,
// and which file that was. Every operation replays only the tail written
// since, as c10d does.
type table struct {
	kv     map[string]string
	offset int64
	file   os.FileInfo // the file last replayed; nil before the first replay
}

func newTable() table { return table{kv: make(map[string]string)} }

// apply replays one record: last record wins, tombstones delete.
func (t *table) apply(r record) {
	if target, ok := strings.CutPrefix(r.key, tombstonePrefix); ok {
		delete(t.kv, target)
		return
	}
	t.kv[r.key] = r.value
}

// replay brings t up to the end of f, whose Stat is fi. The caller holds a
// flock on f, so the tail holds whole records.
//
// If path now names a different file than last time, or a shorter one, the
// old file was removed (a cleanup rule fired) and replaced: gorun starts over
// from offset 0 rather than serve the dead file's keys. c10d keeps its stale
// cache in that case; the file bytes are the same either way. Inode numbers
// can be reused, so this is best effort, which is why the launcher gives each
// rendezvous round a fresh file name.
func (t *table) replay(f *os.File, fi os.FileInfo) error {
	size := fi.Size()
	if t.file != nil && (!os.SameFile(t.file, fi) || size < t.offset) {
		clear(t.kv)
		t.offset = 0
	}
	t.file = fi
	if size == t.offset {
		return nil
	}
	r := bufio.NewReader(io.NewSectionReader(f, t.offset, size-t.offset))
	for t.offset < size {
		rec, n, err := readRecord(r, size-t.offset)
		if err != nil {
			return fmt.Errorf("%w: %s at offset %d: %w", ErrCorrupt, f.Name(), t.offset, err)
		}
		t.apply(rec)
		t.offset += n
	}
	return nil
}

// readRecord decodes one record from r, which holds at most avail bytes, and
// returns it with its encoded length. Lengths are checked against avail
// before anything is allocated, so a damaged length cannot ask for gigabytes.
func readRecord(r io.Reader, avail int64) (record, int64, error) {
	var n int64
	field := func() (string, error) {
		var hdr [4]byte
		if avail-n < int64(len(hdr)) {
			return "", io.ErrUnexpectedEOF
		}
		if _, err := io.ReadFull(r, hdr[:]); err != nil {
			return "", err
		}
		n += int64(len(hdr))
		l := int64(binary.LittleEndian.Uint32(hdr[:]))
		if l > avail-n {
			return "", fmt.Errorf("length %d exceeds the %d bytes left: %w", l, avail-n, io.ErrUnexpectedEOF)
		}
		b := make([]byte, l)
		if _, err := io.ReadFull(r, b); err != nil {
			return "", err
		}
		n += l
		return string(b), nil
	}
	key, err := field()
	if err != nil {
		return record{}, 0, err
	}
	value, err := field()
	if err != nil {
		return record{}, 0, err
	}
	return record{key, value}, n, nil
}
