package pg

import (
	"fmt"
	"unsafe"
)

// DType is the element type of a Buffer. The values are NCCL's ncclDataType_t
// codes, so a backend built on NCCL passes them through unchanged.
type DType int

const (
	Int32    DType = 2 // ncclInt32
	Int64    DType = 4 // ncclInt64
	Float16  DType = 6 // ncclFloat16; NCCL only
	Float32  DType = 7 // ncclFloat32
	Float64  DType = 8 // ncclFloat64
	BFloat16 DType = 9 // ncclBfloat16; NCCL only
)

// Size returns the size of one element in bytes, or 0 for an unknown DType.
func (d DType) Size() int {
	switch d {
	case Float16, BFloat16:
		return 2
	case Int32, Float32:
		return 4
	case Int64, Float64:
		return 8
	}
	return 0
}

func (d DType) String() string {
	switch d {
	case Int32:
		return "int32"
	case Int64:
		return "int64"
	case Float16:
		return "float16"
	case Float32:
		return "float32"
	case Float64:
		return "float64"
	case BFloat16:
		return "bfloat16"
	}
	return fmt.Sprintf("DType(%d)", int(d))
}

// ReduceOp is how AllReduce and ReduceScatter combine elements. The values
// are NCCL's ncclRedOp_t codes.
type ReduceOp int

const (
	Sum  ReduceOp = 0 // ncclSum
	Prod ReduceOp = 1 // ncclProd
	Max  ReduceOp = 2 // ncclMax
	Min  ReduceOp = 3 // ncclMin
	// Avg is Sum divided by the group size; on integer types the division
	// truncates toward zero, as NCCL's ncclAvg does.
	Avg ReduceOp = 4 // ncclAvg
)

func (o ReduceOp) String() string {
	switch o {
	case Sum:
		return "sum"
	case Prod:
		return "prod"
	case Max:
		return "max"
	case Min:
		return "min"
	case Avg:
		return "avg"
	}
	return fmt.Sprintf("ReduceOp(%d)", int(o))
}

// Valid reports whether o is one of the five operations.
func (o ReduceOp) Valid() bool { return o >= Sum && o <= Avg }

// Buffer is a contiguous array of Len elements of one DType. Where it lives
// (host or device memory) is the backend's business: pg/cpu takes a
// HostBuffer, pg/nccl a device buffer of its own.
type Buffer interface {
	DType() DType
	Len() int
}

// Element is a Go type with a DType.
type Element interface {
	~float32 | ~float64 | ~int32 | ~int64
}

// DTypeOf returns the DType of T (named types by their underlying type).
func DTypeOf[T Element]() DType {
	var z T
	isFloat := T(1)/T(2) != z // 0.5 for floats, 0 for integers
	switch {
	case unsafe.Sizeof(z) == 4 && isFloat:
		return Float32
	case unsafe.Sizeof(z) == 4:
		return Int32
	case isFloat:
		return Float64
	default:
		return Int64
	}
}

// HostBuffer is a Buffer in host memory. It is a view: it shares memory
// with the slice it was made from.
type HostBuffer struct {
	dtype DType
	data  []byte
}

var _ Buffer = HostBuffer{}

// Host returns a HostBuffer viewing s (no copy).
func Host[T Element](s []T) HostBuffer {
	var z T
	return HostBuffer{dtype: DTypeOf[T](), data: unsafe.Slice((*byte)(unsafe.Pointer(unsafe.SliceData(s))), len(s)*int(unsafe.Sizeof(z)))}
}

// HostBytes returns a HostBuffer of dtype viewing b, which must hold a whole
// number of elements. It is how float16 and bfloat16 data, which Go has no
// type for, are passed.
func HostBytes(dtype DType, b []byte) (HostBuffer, error) {
	sz := dtype.Size()
	if sz == 0 {
		return HostBuffer{}, invalidf("unknown dtype %v", dtype)
	}
	if len(b)%sz != 0 {
		return HostBuffer{}, invalidf("%d bytes is not a whole number of %v elements", len(b), dtype)
	}
	return HostBuffer{dtype: dtype, data: b}, nil
}

// NewHost allocates a zeroed HostBuffer of n elements of dtype, aligned for
// any element type.
func NewHost(dtype DType, n int) HostBuffer {
	words := make([]uint64, (n*dtype.Size()+7)/8)
	b := unsafe.Slice((*byte)(unsafe.Pointer(unsafe.SliceData(words))), len(words)*8)
	return HostBuffer{dtype: dtype, data: b[:n*dtype.Size()]}
}

func (b HostBuffer) DType() DType { return b.dtype }

func (b HostBuffer) Len() int {
	if sz := b.dtype.Size(); sz > 0 {
		return len(b.data) / sz
	}
	return 0
}

// Bytes returns the buffer's memory.
func (b HostBuffer) Bytes() []byte { return b.data }

// Slice returns elements [i, j) as a HostBuffer sharing memory with b.
func (b HostBuffer) Slice(i, j int) HostBuffer {
	sz := b.dtype.Size()
	return HostBuffer{dtype: b.dtype, data: b.data[i*sz : j*sz : j*sz]}
}

// HostSlice returns b's memory as a []T. It panics if T's DType is not b's.
func HostSlice[T Element](b HostBuffer) []T {
	if d := DTypeOf[T](); d != b.dtype {
		panic(fmt.Sprintf("pg: HostSlice of a %v buffer as %v", b.dtype, d))
	}
	var z T
	n := len(b.data) / int(unsafe.Sizeof(z))
	if n == 0 {
		return nil
	}
	return unsafe.Slice((*T)(unsafe.Pointer(unsafe.SliceData(b.data))), n)
}
