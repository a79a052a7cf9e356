package nccl

import (
	"fmt"
	"os"
	"time"

	"github.com/gorunhq/gorun/pg"
)

// Defaults of the Config fields.
const (
	// DefaultNCCLLibrary is the name dlopen looks up (LD_LIBRARY_PATH, the
	// ld.so cache). PyTorch's pip wheels ship it as
	// site-packages/nvidia/nccl/lib/libnccl.so.2: pass that path, or set
	// GORUN_NCCL_LIBRARY.
	DefaultNCCLLibrary = "libnccl.so.2"
	// DefaultCUDALibrary is the CUDA driver, installed with the GPU driver.
	DefaultCUDALibrary = "libcuda.so.1"
	// DefaultWatchdogInterval is how often the watchdog polls
	// ncclCommGetAsyncError. PyTorch's watchdog wakes every 10 s; the call
	// reads a flag, so gorun polls often and notices a dead peer in about
	// this long.
	DefaultWatchdogInterval = 100 * time.Millisecond
	// DefaultMaxPollInterval caps the pause between two checks of a
	// collective's stream while waiting for it. The pause starts at a few
	// microseconds and doubles up to this; PyTorch's blocking wait sleeps
	// 10 ms between checks.
	DefaultMaxPollInterval = time.Millisecond
)

// Environment variables that override Config's library names when the
// field is empty.
const (
	EnvNCCLLibrary = "GORUN_NCCL_LIBRARY"
	EnvCUDALibrary = "GORUN_CUDA_LIBRARY"
)

// DeviceFromRank in Config.Device picks the device as PyTorch does without a
// device_id: LOCAL_RANK when it is set, else Bootstrap.Rank, modulo the
// number of devices the driver sees.
const DeviceFromRank = -1

// Config configures New. Start from DefaultConfig; the zero values of the
// durations and library names also mean their defaults.
type Config struct {
	// Bootstrap says where the ranks meet (the unique id is exchanged
	// through its Store, under its Namespace), who this rank is and how
	// long forming the group and each collective may take. Required.
	Bootstrap pg.Bootstrap

	// Device is the CUDA device ordinal this rank uses. Default
	// DeviceFromRank.
	Device int

	// NonBlocking creates the communicator with config.blocking = 0: init,
	// collectives and shrink return at once (ncclInProgress) and the group
	// polls ncclCommGetAsyncError until they are done, so that no NCCL call
	// blocks and Abort never waits behind one. It needs NCCL 2.14. Default
	// false: blocking, as PyTorch (TORCH_NCCL_USE_COMM_NONBLOCKING unset).
	NonBlocking bool

	// FreeOnAbort makes Abort, and the watchdog, free the communicator at
	// once with ncclCommAbort, as PyTorch's watchdog does; Shrink then
	// forms the survivors' communicator afresh. Default false: the
	// communicator is kept so that the survivors can shrink it in place,
	// as pg.ProcessGroup promises of an aborted group. Where the library
	// has ncclCommRevoke (NCCL ≥ 2.28.7) Abort revokes it, which ends the
	// operations in flight on the device; on
	// older libraries an operation stuck on the device stays until Shrink
	// with pg.ShrinkAbort (NCCL_SHRINK_ABORT terminates it) or Close
	// (ncclCommAbort). Either way the Go calls waiting for it return at once.
	FreeOnAbort bool

	// WatchdogInterval is how often the watchdog polls
	// ncclCommGetAsyncError. On an error it aborts the group and records
	// the error for AsyncError. Default DefaultWatchdogInterval; negative
	// disables the watchdog (collectives still check for async errors
	// while they wait).
	WatchdogInterval time.Duration

	// MaxPollInterval caps the pause between two checks of a collective
	// in flight (stream query, async error, cancellation). Default
	// DefaultMaxPollInterval.
	MaxPollInterval time.Duration

	// NCCLLibrary is what dlopen loads for NCCL: a name or a path.
	// Default: $GORUN_NCCL_LIBRARY, else DefaultNCCLLibrary.
	NCCLLibrary string
	// CUDALibrary is what dlopen loads for the CUDA driver. Default:
	// $GORUN_CUDA_LIBRARY, else DefaultCUDALibrary.
	CUDALibrary string
}

// DefaultConfig returns a Config with every default spelled out; set
// Bootstrap before passing it to New.
func DefaultConfig() Config {
	return Config{
		Device:           DeviceFromRank,
		WatchdogInterval: DefaultWatchdogInterval,
		MaxPollInterval:  DefaultMaxPollInterval,
		NCCLLibrary:      envOr(EnvNCCLLibrary, DefaultNCCLLibrary),
		CUDALibrary:      envOr(EnvCUDALibrary, DefaultCUDALibrary),
	}
}

// withDefaults fills the zero fields and checks the rest.
func (c Config) withDefaults() (Config, error) {
	if err := c.Bootstrap.Validate(); err != nil {
		return c, err
	}
	if c.Device < DeviceFromRank {
		return c, fmt.Errorf("%w: pg/nccl: device %d", pg.ErrInvalidArgument, c.Device)
	}
	if c.WatchdogInterval == 0 {
		c.WatchdogInterval = DefaultWatchdogInterval
	}
	if c.MaxPollInterval <= 0 {
		c.MaxPollInterval = DefaultMaxPollInterval
	}
	if c.NCCLLibrary == "" {
		c.NCCLLibrary = envOr(EnvNCCLLibrary, DefaultNCCLLibrary)
	}
	if c.CUDALibrary == "" {
		c.CUDALibrary = envOr(EnvCUDALibrary, DefaultCUDALibrary)
	}
	return c, nil
}

func envOr(key, def string) string {
	if v := os.Getenv(key); v != "" {
		return v
	}
	return def
}
