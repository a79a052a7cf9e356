package cpu

import (
	"unsafe"

	"github.com/gorunhq/gorun/pg"
)

// reducer computes dst[i] = a[i] op b[i] over byte views of one dtype. dst
// may be a; every operand holds len(dst) bytes or more.
type reducer func(dst, a, b []byte)

// reducerFor returns the kernel for dtype and op; Avg reduces as Sum (the
// division is finish's job). dtype and op must be valid.
func reducerFor(dtype pg.DType, op pg.ReduceOp) reducer { return kernels[dtypeIndex(dtype)][op] }

// kernels is built once, so that picking a kernel costs no allocation.
var kernels = [4][5]reducer{kernelRow[float32](), kernelRow[float64](), kernelRow[int32](), kernelRow[int64]()}

func dtypeIndex(d pg.DType) int {
	switch d {
	case pg.Float32:
		return 0
	case pg.Float64:
		return 1
	case pg.Int32:
		return 2
	default:
		return 3
	}
}

// kernelRow returns T's kernels indexed by pg.ReduceOp.
func kernelRow[T pg.Element]() [5]reducer {
	return [5]reducer{pg.Sum: sum[T], pg.Prod: prod[T], pg.Max: maxOf[T], pg.Min: minOf[T], pg.Avg: sum[T]}
}

// view returns b as a []T (b is aligned for T: buffers and scratch are).
func view[T pg.Element](b []byte) []T {
	var z T
	n := len(b) / int(unsafe.Sizeof(z))
	if n == 0 {
		return nil
	}
	return unsafe.Slice((*T)(unsafe.Pointer(unsafe.SliceData(b))), n)
}

func sum[T pg.Element](dst, a, b []byte) {
	d := view[T](dst)
	x, y := view[T](a)[:len(d)], view[T](b)[:len(d)]
	i := 0
	for ; i+4 <= len(d); i += 4 {
		d0, x0, y0 := d[i:i+4:i+4], x[i:i+4:i+4], y[i:i+4:i+4]
		d0[0] = x0[0] + y0[0]
		d0[1] = x0[1] + y0[1]
		d0[2] = x0[2] + y0[2]
		d0[3] = x0[3] + y0[3]
	}
	for ; i < len(d); i++ {
		d[i] = x[i] + y[i]
	}
}

func prod[T pg.Element](dst, a, b []byte) {
	d := view[T](dst)
	x, y := view[T](a)[:len(d)], view[T](b)[:len(d)]
	for i := range d {
		d[i] = x[i] * y[i]
	}
}

func maxOf[T pg.Element](dst, a, b []byte) {
	d := view[T](dst)
	x, y := view[T](a)[:len(d)], view[T](b)[:len(d)]
	for i := range d {
		d[i] = max(x[i], y[i])
	}
}

func minOf[T pg.Element](dst, a, b []byte) {
	d := view[T](dst)
	x, y := view[T](a)[:len(d)], view[T](b)[:len(d)]
	for i := range d {
		d[i] = min(x[i], y[i])
	}
}

// finish applies what remains of op once the reduction is done: Avg divides
// by n (truncating toward zero on integers, as NCCL's ncclAvg does).
func finish(b []byte, dtype pg.DType, op pg.ReduceOp, n int) {
	if op != pg.Avg || n == 1 {
		return
	}
	switch dtype {
	case pg.Float32:
		divide(view[float32](b), float32(n))
	case pg.Float64:
		divide(view[float64](b), float64(n))
	case pg.Int32:
		divide(view[int32](b), int32(n))
	case pg.Int64:
		divide(view[int64](b), int64(n))
	}
}

func divide[T pg.Element](v []T, n T) {
	for i := range v {
		v[i] /= n
	}
}
