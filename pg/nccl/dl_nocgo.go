//go:build !cgo

package nccl

import "errors"

// errNoCgo is what New says in a build without cgo: NCCL and the CUDA driver
// are loaded with dlopen, which takes cgo.
var errNoCgo = errors.New("pg/nccl needs cgo (it loads libnccl.so.2 and libcuda.so.1 with dlopen): build with CGO_ENABLED=1")

func openNCCL(string) (ncclAPI, error) { return nil, errNoCgo }

func openCUDA(string) (cudaAPI, error)            { return nil, errNoCgo }
func probeSymbols(string) ([]probedSymbol, error) { return nil, errNoCgo }
