// Package nccl is a pg.ProcessGroup on NVIDIA's NCCL, loaded at run time.
//
// libnccl.so.2 and the CUDA driver (libcuda.so.1) are opened with dlopen
// when New is called, so building a program that imports this package
// needs neither CUDA nor NCCL headers or libraries, only cgo. Without cgo
// the package still builds and New says it needs cgo. The gorun launcher
// itself (cmd/gorun) never imports it: it is for worker programs.
//
// What it does, following PyTorch's ProcessGroupNCCL where it has an
// answer:
//
//   - New finds the GPU ("ProcessGroupNCCL is only supported with GPUs, no
//     GPUs found!" when there is none), loads NCCL, and exchanges the
//     ncclUniqueId through the bootstrap store: rank 0 sets the 128 raw
//     bytes under the decimal key "0" of the bootstrap namespace, the
//     others get it. A second generation of a job needs a fresh namespace.
//   - Communicators are blocking (ncclCommInitRank / ncclCommInitRankConfig)
//     or non-blocking (config.blocking = 0, polled until done). A blocking
//     init (or a newcomer's grow) waits for every rank, a lost one too, and
//     NCCL gives nothing to abort until it returns: it runs on a goroutine
//     of its own and is given up at the context's end or the bootstrap
//     timeout, left to NCCL, its communicator aborted if it ever forms. So
//     a member waiting in a first formation for a rank that died can still
//     move to the epoch without it (shrink.Launched).
//   - Collectives run on device memory (DeviceBuffer) on the group's
//     stream and are waited for by polling, so a context deadline, Abort
//     or the watchdog end the wait; float16 and bfloat16 work here.
//   - Abort stops the group at once and revokes the communicator where NCCL
//     can (ncclCommRevoke, ≥ 2.28.7), keeping it so that survivors can
//     shrink it; Close (or the abortive shrink) frees it with ncclCommAbort,
//     never ncclCommDestroy, which waits for peers that may be gone. A
//     watchdog polls ncclCommGetAsyncError and aborts the group on an error
//     (a dead peer: pg.ErrPeerLost). Config.FreeOnAbort gives PyTorch's
//     free-at-once behaviour instead.
//   - Shrink is ncclCommShrink (NCCL ≥ 2.27.3) with NCCL_SHRINK_DEFAULT or
//     NCCL_SHRINK_ABORT; Revoke is ncclCommRevoke (NCCL ≥ 2.28.7). NCCL
//     will not shrink a communicator that recorded an async error (a dead
//     peer on a socket or InfiniBand connection leaves ncclRemoteError at
//     the survivors connected to it): the survivors agree through the
//     store first, and form a fresh communicator when any one cannot.
//   - Grow (pg.Grower) and JoinGrow take newcomers in: ncclCommGrow (NCCL ≥
//     2.29) with an id from the root member's ncclCommGetUniqueId, published
//     like New's under the key "0" of the grow's namespace once every
//     newcomer has announced itself, on blocking groups; older libraries
//     and non-blocking groups form a fresh communicator of the grown size
//     with the same ranks (a non-blocking ncclCommGrow crashed newcomers in
//     half the runs on an H200 with NCCL 2.29.7). A newcomer that
//     never comes ends the grow at the context's end, before any NCCL call,
//     and the members keep their group.
//
// Probe (and `gpusmoke -probe`) checks a library without a GPU: it resolves
// every entry point the package uses and calls ncclGetVersion and
// ncclGetUniqueId.
//
// The bindings sit behind two small interfaces (api.go), so the group's
// logic is tested without a GPU against a test double: a small C library
// built from testdata that exports the same entry points. It is not NCCL.
// The real NCCL (2.29.7, from the sid bed, internal/sidbed) is tested too,
// as far as it goes without a device: its symbol table and version gates, a
// unique id exchanged through a store, ncclCommInitRankConfig's and a
// newcomer's ncclCommGrow's failures, ncclCommGrow's argument checks, and
// the ncclConfig_t prefix (gr_config.h) compiled against its nccl.h. On a
// machine with a GPU, TestGPUShrinkGrow (run by scripts/gpu-check.sh) forms
// a group of three rank processes, kills one, shrinks and grows a newcomer
// in on the real library; it passed on an H100 with NCCL 2.28.9.
package nccl
