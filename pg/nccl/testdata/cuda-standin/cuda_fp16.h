// STAND-IN for the CUDA fp16 header (see cuda_runtime.h here): nccl.h
// includes it and uses nothing from it. Not CUDA.
