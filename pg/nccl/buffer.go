package nccl

import (
	"fmt"
	"sync"
	"sync/atomic"

	"github.com/gorunhq/gorun/pg"
)

// device is one CUDA device's primary context, retained by a Group (the
// driver counts retains: the context lives while any Group on the device
// is open).
type device struct {
	cuda    cudaAPI
	ordinal int
	ctx     ctxHandle
	once    sync.Once
}

func retainDevice(cuda cudaAPI, ordinal int) (*device, error) {
	ctx, code := cuda.primaryCtxRetain(ordinal)
	if code != cudaSuccess {
		return nil, cudaError(cuda, "cuDevicePrimaryCtxRetain", code)
	}
	return &device{cuda: cuda, ordinal: ordinal, ctx: ctx}, nil
}

func (d *device) release() {
	d.once.Do(func() { d.cuda.primaryCtxRelease(d.ordinal) })
}

func (d *device) alloc(dtype pg.DType, n int) (*DeviceBuffer, error) {
	sz := dtype.Size()
	if sz == 0 || n < 0 {
		return nil, fmt.Errorf("%w: pg/nccl: alloc of %d %v elements", pg.ErrInvalidArgument, n, dtype)
	}
	b := &DeviceBuffer{dev: d, dtype: dtype, n: n}
	if n == 0 {
		return b, nil
	}
	p, code := d.cuda.memAlloc(d.ctx, n*sz)
	if code != cudaSuccess {
		return nil, cudaError(d.cuda, "cuMemAlloc_v2", code)
	}
	b.ptr = p
	return b, nil
}

// DeviceBuffer is a pg.Buffer in device memory: Len elements of DType at a
// device pointer, in the primary context of one device. Collectives of a
// Group on that device take it; CopyFromHost and CopyToHost move data.
//
// It lives in the device's primary context, which the driver keeps while
// any Group on the device is open: Free it before closing the last one.
// A DeviceBuffer is not safe for concurrent Free and use.
type DeviceBuffer struct {
	dev      *device
	ptr      devPtr
	dtype    pg.DType
	n        int
	released atomic.Bool
}

var _ pg.Buffer = (*DeviceBuffer)(nil)

// Alloc allocates n elements of dtype on the group's device
// (cuMemAlloc). The memory is not zeroed.
func (g *Group) Alloc(dtype pg.DType, n int) (*DeviceBuffer, error) {
	return g.dev.alloc(dtype, n)
}

// Upload allocates a DeviceBuffer of h's type and length and copies h into
// it.
func (g *Group) Upload(h pg.HostBuffer) (*DeviceBuffer, error) {
	b, err := g.Alloc(h.DType(), h.Len())
	if err != nil {
		return nil, err
	}
	if err := b.CopyFromHost(h); err != nil {
		_ = b.Free()
		return nil, err
	}
	return b, nil
}

// DType is the element type.
func (b *DeviceBuffer) DType() pg.DType { return b.dtype }

// Len is the number of elements.
func (b *DeviceBuffer) Len() int { return b.n }

// Device is the CUDA device ordinal the memory is on.
func (b *DeviceBuffer) Device() int { return b.dev.ordinal }

// Ptr is the device pointer (CUdeviceptr), for passing to other CUDA code.
func (b *DeviceBuffer) Ptr() uintptr { return uintptr(b.ptr) }

func (b *DeviceBuffer) freed() bool { return b.released.Load() }

func (b *DeviceBuffer) check(op string, h pg.HostBuffer) error {
	switch {
	case b.freed():
		return fmt.Errorf("%w: pg/nccl: %s: buffer was freed", pg.ErrInvalidArgument, op)
	case h.DType() != b.dtype || h.Len() != b.n:
		return fmt.Errorf("%w: pg/nccl: %s: host buffer is %d %v, device buffer %d %v",
			pg.ErrInvalidArgument, op, h.Len(), h.DType(), b.n, b.dtype)
	}
	return nil
}

// CopyFromHost copies src, which must have b's type and length, into b
// (cuMemcpyHtoD; synchronous).
func (b *DeviceBuffer) CopyFromHost(src pg.HostBuffer) error {
	if err := b.check("copy to device", src); err != nil {
		return err
	}
	if code := b.dev.cuda.memcpyHtoD(b.dev.ctx, b.ptr, src.Bytes()); code != cudaSuccess {
		return cudaError(b.dev.cuda, "cuMemcpyHtoD_v2", code)
	}
	return nil
}

// CopyToHost copies b into dst, which must have b's type and length
// (cuMemcpyDtoH; synchronous).
func (b *DeviceBuffer) CopyToHost(dst pg.HostBuffer) error {
	if err := b.check("copy to host", dst); err != nil {
		return err
	}
	if code := b.dev.cuda.memcpyDtoH(b.dev.ctx, dst.Bytes(), b.ptr); code != cudaSuccess {
		return cudaError(b.dev.cuda, "cuMemcpyDtoH_v2", code)
	}
	return nil
}

// Free releases the memory (cuMemFree). It is idempotent.
func (b *DeviceBuffer) Free() error {
	if !b.released.CompareAndSwap(false, true) || b.ptr == 0 {
		return nil
	}
	if code := b.dev.cuda.memFree(b.dev.ctx, b.ptr); code != cudaSuccess {
		return cudaError(b.dev.cuda, "cuMemFree_v2", code)
	}
	return nil
}
