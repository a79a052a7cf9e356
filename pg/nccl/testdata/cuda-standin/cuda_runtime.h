// STAND-IN for the CUDA runtime header, for the ncclConfig_t layout check
// only (TestConfigLayoutMatchesNCCLHeader): nccl.h includes it, and all it
// needs from it is cudaStream_t and CUDART_VERSION. Not CUDA.
#ifndef GORUN_CUDA_STANDIN_RUNTIME_H
#define GORUN_CUDA_STANDIN_RUNTIME_H
#define CUDART_VERSION 10000 /* below 11000: nccl.h wants no bf16/fp8 headers */
typedef struct CUstream_st *cudaStream_t;
#endif
