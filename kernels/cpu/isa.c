/* The tier this object was compiled for (isa.h), linked into every native library. */
#include "isa.h"

__attribute__((visibility("default"))) const char *pagedserve_isa_tier(void) { return PS_ISA_TIER; }
