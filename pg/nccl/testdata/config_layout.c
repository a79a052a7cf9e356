// config_layout.c checks, at compile time, that the ncclConfig_t prefix
// pg/nccl passes to ncclCommInitRankConfig (gr_config.h) matches the real
// nccl.h: same field offsets and sizes, the same magic, INT_MIN and NULL as
// "undefined", and a version code NCCL_VERSION agrees with. Built by
// TestConfigLayoutMatchesNCCLHeader with stand-in CUDA headers; when run,
// it prints what it checked.
#include <limits.h>
#include <stddef.h>
#include <stdio.h>

#include <nccl.h>

#include "gr_config.h"

#define SAME_FIELD(f)                                                                        \
	_Static_assert(offsetof(gr_config, f) == offsetof(ncclConfig_t, f), "offset of " #f); \
	_Static_assert(sizeof(((gr_config *)0)->f) == sizeof(((ncclConfig_t *)0)->f), "size of " #f)

SAME_FIELD(size);
SAME_FIELD(magic);
SAME_FIELD(version);
SAME_FIELD(blocking);
SAME_FIELD(cgaClusterSize);
SAME_FIELD(minCTAs);
SAME_FIELD(maxCTAs);
SAME_FIELD(netName);

_Static_assert(sizeof(gr_config) <= sizeof(ncclConfig_t), "gr_config is a prefix of ncclConfig_t");
_Static_assert(GR_CONFIG_MAGIC == NCCL_API_MAGIC, "magic");
_Static_assert(GR_CONFIG_VERSION == NCCL_VERSION(2, 17, 0), "version code");
_Static_assert(GR_CONFIG_VERSION <= NCCL_VERSION_CODE, "the prefix is no newer than the library");
_Static_assert(NCCL_CONFIG_UNDEF_INT == INT_MIN, "undefined int");

int main(void) {
	ncclConfig_t c = NCCL_CONFIG_INITIALIZER;
	if (c.magic != GR_CONFIG_MAGIC || c.netName != NULL || c.blocking != INT_MIN) {
		printf("NCCL_CONFIG_INITIALIZER disagrees\n");
		return 1;
	}
	printf("nccl.h %d.%d.%d: ncclConfig_t %zu bytes, gr_config prefix %zu bytes, magic %#x\n",
	       NCCL_MAJOR, NCCL_MINOR, NCCL_PATCH, sizeof(ncclConfig_t), sizeof(gr_config), c.magic);
	return 0;
}
