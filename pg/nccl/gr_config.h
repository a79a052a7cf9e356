// The ncclConfig_t prefix pg/nccl passes to ncclCommInitRankConfig, shared
// by dl_cgo.go and the layout check against the real nccl.h
// (testdata/config_layout.c, run by TestConfigLayoutMatchesNCCLHeader).
#ifndef GORUN_GR_CONFIG_H
#define GORUN_GR_CONFIG_H

#include <stddef.h>

// ncclConfig_t as of NCCL 2.17 (version code 21700). NCCL copies
// min(size, sizeof its own ncclConfig_t) bytes, keeps its defaults for the
// rest, and ignores fields newer than the version given, so every library
// from 2.14 on accepts it.
typedef struct {
	size_t size;
	unsigned int magic;
	unsigned int version;
	int blocking;
	int cgaClusterSize;
	int minCTAs;
	int maxCTAs;
	const char *netName;
} gr_config;

// NCCL_API_MAGIC, and NCCL_VERSION(2, 17, 0).
#define GR_CONFIG_MAGIC 0xcafebeef
#define GR_CONFIG_VERSION 21700

#endif
