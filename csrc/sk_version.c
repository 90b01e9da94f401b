/* ABI identification of the core. */
#include "skippy_abi.h"

skippy_version skippy_scheduler_abi_version(void);
uint32_t skippy_scheduler_plan_abi_version(void);

skippy_version skippy_scheduler_abi_version(void)
{
    skippy_version v = {SKIPPY_ABI_VERSION_MAJOR, SKIPPY_ABI_VERSION_MINOR, SKIPPY_ABI_VERSION_PATCH};
    return v;
}

uint32_t skippy_scheduler_plan_abi_version(void) { return SKIPPY_PLAN_ABI_VERSION; }
