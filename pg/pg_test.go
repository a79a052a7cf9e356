package pg

import (
	"errors"
	"io"
	"slices"
	"strings"
	"testing"

	"github.com/gorunhq/gorun/rendezvous"
)

// nopStore is a rendezvous.Store whose methods are never called: Bootstrap
// only checks that a store is there.
type nopStore struct{ rendezvous.Store }

func TestValidateShrink(t *testing.T) {
	tests := []struct {
		name          string
		rank, size    int
		exclude       []int
		flags         ShrinkFlags
		wantSubstring string // "" means valid
	}{
		{"one middle rank", 0, 8, []int{3}, ShrinkDefault, ""},
		{"several, any order, abort", 7, 8, []int{5, 1, 2}, ShrinkAbort, ""},
		{"all but one", 0, 4, []int{1, 2, 3}, ShrinkDefault, ""},
		{"empty", 0, 4, nil, ShrinkDefault, "ranks_to_exclude cannot be empty"},
		{"bad flags", 0, 4, []int{1}, ShrinkFlags(2), "Invalid shrink_flags value: 2"},
		{"group of one", 0, 1, []int{0}, ShrinkDefault, "Cannot shrink a process group with size 1"},
		{"out of range high", 0, 4, []int{5}, ShrinkDefault, "Rank 5 at index 0 is out of bounds for group size 4. Valid ranks are in range [0, 3]."},
		{"out of range negative", 0, 4, []int{1, -1}, ShrinkDefault, "Rank -1 at index 1 is out of bounds"},
		// PyTorch checks duplicates before self-exclusion: [0, 0, 1] from
		// rank 0 reports the duplicate.
		{"duplicate before self", 0, 4, []int{0, 0, 1}, ShrinkDefault, "Duplicate rank 0 found in ranks_to_exclude at index 1"},
		{"everyone", 1, 3, []int{0, 1, 2}, ShrinkDefault, "Cannot exclude all 3 ranks from process group. At least one rank must remain. Excluding 3 ranks."},
		{"caller excluded", 2, 4, []int{2}, ShrinkDefault, "Current rank 2 is in the exclusion list and should not call shrink_group()"},
		// Empty is checked before flags and size, as upstream orders it.
		{"empty on a group of one with bad flags", 0, 1, []int{}, ShrinkFlags(9), "cannot be empty"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := ValidateShrink(tt.rank, tt.size, tt.exclude, tt.flags)
			if tt.wantSubstring == "" {
				if err != nil {
					t.Fatalf("ValidateShrink = %v, want nil", err)
				}
				return
			}
			if err == nil {
				t.Fatalf("ValidateShrink = nil, want an error containing %q", tt.wantSubstring)
			}
			if !errors.Is(err, ErrInvalidArgument) {
				t.Errorf("error %v does not wrap ErrInvalidArgument", err)
			}
			if !strings.Contains(err.Error(), tt.wantSubstring) {
				t.Errorf("error %q does not contain %q", err, tt.wantSubstring)
			}
		})
	}
}

func TestSurvivors(t *testing.T) {
	tests := []struct {
		size    int
		exclude []int
		want    []int
	}{
		{8, []int{7}, []int{0, 1, 2, 3, 4, 5, 6, -1}},
		{8, []int{0}, []int{-1, 0, 1, 2, 3, 4, 5, 6}},
		// PyTorch's multiple-exclusions test drops range(2, ws, 2).
		{8, []int{6, 2, 4}, []int{0, 1, -1, 2, -1, 3, -1, 4}},
		{2, []int{1}, []int{0, -1}},
	}
	for _, tt := range tests {
		if got := Survivors(tt.size, tt.exclude); !slices.Equal(got, tt.want) {
			t.Errorf("Survivors(%d, %v) = %v, want %v", tt.size, tt.exclude, got, tt.want)
		}
	}
}

func TestDTypeOf(t *testing.T) {
	type celsius float64
	type count int32
	tests := []struct {
		got, want DType
	}{
		{DTypeOf[float32](), Float32},
		{DTypeOf[float64](), Float64},
		{DTypeOf[int32](), Int32},
		{DTypeOf[int64](), Int64},
		{DTypeOf[celsius](), Float64},
		{DTypeOf[count](), Int32},
	}
	for i, tt := range tests {
		if tt.got != tt.want {
			t.Errorf("case %d: DTypeOf = %v, want %v", i, tt.got, tt.want)
		}
	}
}

func TestHostBufferViews(t *testing.T) {
	s := []float32{1, 2, 3, 4, 5}
	b := Host(s)
	if b.DType() != Float32 || b.Len() != 5 || len(b.Bytes()) != 20 {
		t.Fatalf("Host: dtype %v len %d bytes %d", b.DType(), b.Len(), len(b.Bytes()))
	}
	// A view, not a copy: writes through the buffer reach the slice.
	HostSlice[float32](b.Slice(1, 3))[1] = 30
	if s[2] != 30 {
		t.Errorf("write through Slice(1,3)[1] did not reach s[2]: %v", s)
	}
	if got := b.Slice(3, 5).Len(); got != 2 {
		t.Errorf("Slice(3,5).Len() = %d, want 2", got)
	}
	if got := HostSlice[float32](Host([]float32{})); got != nil {
		t.Errorf("HostSlice of an empty buffer = %v, want nil", got)
	}

	n := NewHost(Int64, 3)
	if n.Len() != 3 || n.DType() != Int64 {
		t.Fatalf("NewHost: %v × %d", n.DType(), n.Len())
	}
	HostSlice[int64](n)[2] = -7
	if HostSlice[int64](n)[2] != -7 {
		t.Error("NewHost memory is not writable through HostSlice")
	}

	defer func() {
		if recover() == nil {
			t.Error("HostSlice[float64] of a float32 buffer did not panic")
		}
	}()
	HostSlice[float64](b)
}

func TestHostBytes(t *testing.T) {
	if b, err := HostBytes(BFloat16, make([]byte, 6)); err != nil || b.Len() != 3 || b.DType() != BFloat16 {
		t.Errorf("HostBytes(bfloat16, 6 bytes) = %v × %d, %v", b.DType(), b.Len(), err)
	}
	if _, err := HostBytes(Float32, make([]byte, 6)); !errors.Is(err, ErrInvalidArgument) {
		t.Errorf("HostBytes(float32, 6 bytes) error = %v, want ErrInvalidArgument", err)
	}
	if _, err := HostBytes(DType(99), make([]byte, 4)); !errors.Is(err, ErrInvalidArgument) {
		t.Errorf("HostBytes(unknown dtype) error = %v, want ErrInvalidArgument", err)
	}
}

func TestErrors(t *testing.T) {
	reason := errors.New("rank 3 lost in epoch 2")
	ab := NewAbortedError(reason)
	if !errors.Is(ab, ErrAborted) || !errors.Is(ab, reason) {
		t.Errorf("AbortedError %v: Is(ErrAborted)=%v Is(reason)=%v", ab, errors.Is(ab, ErrAborted), errors.Is(ab, reason))
	}
	if got, want := ab.Error(), "process group aborted: rank 3 lost in epoch 2"; got != want {
		t.Errorf("AbortedError.Error() = %q, want %q", got, want)
	}
	if got := NewAbortedError(nil).Error(); !strings.Contains(got, "aborted by the caller") {
		t.Errorf("NewAbortedError(nil) = %q, want it to say the caller aborted", got)
	}

	if got, want := (&PeerError{Rank: -1, Op: "ncclAllReduce", Err: io.EOF}).Error(), "ncclAllReduce: a peer was lost: EOF"; got != want {
		t.Errorf("PeerError with an unknown rank = %q, want %q", got, want)
	}
	pe := error(&PeerError{Rank: 5, Op: "allreduce", Err: io.EOF})
	if !errors.Is(pe, ErrPeerLost) || !errors.Is(pe, io.EOF) {
		t.Errorf("PeerError does not wrap both ErrPeerLost and its cause")
	}
	var target *PeerError
	if !errors.As(pe, &target) || target.Rank != 5 {
		t.Errorf("errors.As(PeerError) = %v, rank %v", target, target)
	}
	if got, want := pe.Error(), "allreduce: peer rank 5 lost: EOF"; got != want {
		t.Errorf("PeerError.Error() = %q, want %q", got, want)
	}
}

func TestBootstrapValidate(t *testing.T) {
	ok := Bootstrap{Store: nopStore{}, Rank: 1, Size: 2}
	if err := ok.Validate(); err != nil {
		t.Fatalf("Validate(%+v) = %v", ok, err)
	}
	if ok.OpTimeout() != DefaultTimeout {
		t.Errorf("OpTimeout() = %v, want the default", ok.OpTimeout())
	}
	bad := []Bootstrap{
		{Rank: 0, Size: 1},
		{Store: nopStore{}, Rank: 0, Size: 0},
		{Store: nopStore{}, Rank: 2, Size: 2},
		{Store: nopStore{}, Rank: -1, Size: 2},
		{Store: nopStore{}, Rank: 0, Size: 2, Timeout: -1},
	}
	for _, b := range bad {
		if err := b.Validate(); !errors.Is(err, ErrInvalidArgument) {
			t.Errorf("Validate(%+v) = %v, want ErrInvalidArgument", b, err)
		}
	}
}

func TestBootstrapNamespacedStore(t *testing.T) {
	b := Bootstrap{Store: nopStore{}, Size: 1}
	if _, ok := b.NamespacedStore().(nopStore); !ok {
		t.Errorf("NamespacedStore() without a namespace = %T, want the store itself", b.NamespacedStore())
	}
	b.Namespace = "pg/job7"
	ps, ok := b.NamespacedStore().(*rendezvous.PrefixStore)
	if !ok || ps.Key("addr/0") != "pg/job7/addr/0" {
		t.Errorf("NamespacedStore() with a namespace = %T, want a PrefixStore mapping addr/0 to pg/job7/addr/0", b.NamespacedStore())
	}
}
