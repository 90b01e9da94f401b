# Types of the out-of-line cffi module built from abi/skippy_abi_decls.h and
# abi/skippy_scheduler_decls.h. Pointer arguments and results are cffi cdata; a `const char *`
# argument also takes bytes. The functions take positional arguments only, like every cffi call.
from typing import Final, TypeAlias, final

from _cffi_backend import FFI

_CData: TypeAlias = FFI.CData
_Chars: TypeAlias = bytes | FFI.CData

ffi: FFI
lib: _Lib

@final
class _Lib:
    SKIPPY_ABI_FEATURE_ACTIVATION_BOUNDARY: Final[int]
    SKIPPY_ABI_FEATURE_ITERATION_BATCH: Final[int]
    SKIPPY_ABI_FEATURE_MODEL_SOURCE: Final[int]
    SKIPPY_ABI_FEATURE_RECURRENT_STATE: Final[int]
    SKIPPY_ABI_FEATURE_RUNTIME_SLICE: Final[int]
    SKIPPY_ABI_FEATURE_SAMPLING_CONFIG: Final[int]
    SKIPPY_ADMISSION_CACHE_AWARE: Final[int]
    SKIPPY_ADMISSION_CALLBACK: Final[int]
    SKIPPY_ADMISSION_FAIR_SHARE: Final[int]
    SKIPPY_ADMISSION_FCFS: Final[int]
    SKIPPY_ADMISSION_PRIORITY: Final[int]
    SKIPPY_DEFERRED_TOKEN: Final[int]
    SKIPPY_PHASE_DECODE: Final[int]
    SKIPPY_PHASE_PREFILL: Final[int]
    SKIPPY_PHASE_RECOMPUTE: Final[int]
    SKIPPY_PLAN_ABI_VERSION: Final[int]
    SKIPPY_PREEMPT_CALLBACK: Final[int]
    SKIPPY_PREEMPT_FEWEST_COMPUTED: Final[int]
    SKIPPY_PREEMPT_LOWEST_PRIORITY_NEWEST: Final[int]
    SKIPPY_SAMPLING_DRY_BREAKER_BYTES: Final[int]
    SKIPPY_SAMPLING_FLAG_ENABLED: Final[int]
    SKIPPY_SAMPLING_FLAG_IGNORE_EOS: Final[int]
    SKIPPY_SAMPLING_MAX_DRY_BREAKERS: Final[int]
    SKIPPY_SAMPLING_MAX_LOGIT_BIAS: Final[int]
    SKIPPY_SAMPLING_MAX_SAMPLERS: Final[int]
    SKIPPY_SCHED_BAD_OUTPUTS: Final[int]
    SKIPPY_SCHED_CALLBACK: Final[int]
    SKIPPY_SCHED_DUPLICATE: Final[int]
    SKIPPY_SCHED_EMPTY_PROMPT: Final[int]
    SKIPPY_SCHED_INVALID: Final[int]
    SKIPPY_SCHED_NO_MEMORY: Final[int]
    SKIPPY_SCHED_OK: Final[int]
    SKIPPY_SCHED_PLAN_IN_FLIGHT: Final[int]
    SKIPPY_SCHED_QUEUE_FULL: Final[int]
    SKIPPY_SCHED_STALE_PLAN: Final[int]
    SKIPPY_SEQ_CANCELLED: Final[int]
    SKIPPY_SEQ_FAILED: Final[int]
    SKIPPY_SEQ_FINISHED: Final[int]
    SKIPPY_SEQ_PREEMPTED: Final[int]
    SKIPPY_SEQ_RUNNING: Final[int]
    SKIPPY_SEQ_WAITING: Final[int]
    SKIPPY_STATUS_BUFFER_TOO_SMALL: Final[int]
    SKIPPY_STATUS_ERROR: Final[int]
    SKIPPY_STATUS_INVALID_ARGUMENT: Final[int]
    SKIPPY_STATUS_IO_ERROR: Final[int]
    SKIPPY_STATUS_MODEL_ERROR: Final[int]
    SKIPPY_STATUS_OK: Final[int]
    SKIPPY_STATUS_RUNTIME_ERROR: Final[int]
    SKIPPY_STATUS_UNSUPPORTED: Final[int]
    def skippy_scheduler_abi_version(self) -> _CData: ...
    def skippy_scheduler_plan_abi_version(self) -> int: ...
    def skippy_error_free(self, error: _CData, /) -> None: ...
    def skippy_scheduler_config_default(self, config: _CData, /) -> None: ...
    def skippy_scheduler_config_normalize(self, config: _CData, /) -> None: ...
    def skippy_sequence_desc_init(
        self,
        desc: _CData,
        id: _Chars,
        id_len: int,
        prompt_tokens: _CData,
        prompt_count: int,
        max_tokens: int,
        /,
    ) -> None: ...
    def skippy_scheduler_create(
        self, config: _CData, out_scheduler: _CData, out_error: _CData, /
    ) -> int: ...
    def skippy_scheduler_free(self, scheduler: _CData, /) -> None: ...
    def skippy_scheduler_get_config(self, scheduler: _CData, /) -> _CData: ...
    def skippy_scheduler_last_code(self, scheduler: _CData, /) -> int: ...
    def skippy_scheduler_last_message(self, scheduler: _CData, /) -> _CData: ...
    def skippy_scheduler_set_callbacks(
        self, scheduler: _CData, rank: _CData, victim: _CData, ctx: _CData, /
    ) -> None: ...
    def skippy_scheduler_submit(
        self, scheduler: _CData, desc: _CData, out_slot: _CData, out_error: _CData, /
    ) -> int: ...
    def skippy_scheduler_plan(
        self, scheduler: _CData, out_plan: _CData, out_error: _CData, /
    ) -> int: ...
    def skippy_scheduler_observe(
        self, scheduler: _CData, plan_serial: int, elapsed_us: float, out_error: _CData, /
    ) -> int: ...
    def skippy_scheduler_complete(
        self, scheduler: _CData, plan_serial: int, out_telemetry: _CData, out_error: _CData, /
    ) -> int: ...
    def skippy_scheduler_abort(
        self, scheduler: _CData, plan_serial: int, out_error: _CData, /
    ) -> int: ...
    def skippy_scheduler_plan_live(self, scheduler: _CData, plan_serial: int, /) -> bool: ...
    def skippy_scheduler_live_plans(self, scheduler: _CData, /) -> int: ...
    def skippy_scheduler_oldest_plan(self, scheduler: _CData, /) -> int: ...
    def skippy_scheduler_preempt(
        self,
        scheduler: _CData,
        used_bytes: _CData,
        used_count: int,
        out_preempted: _CData,
        out_error: _CData,
        /,
    ) -> int: ...
    def skippy_scheduler_preempted_slots(self, scheduler: _CData, /) -> _CData: ...
    def skippy_scheduler_cancel(self, scheduler: _CData, id: _Chars, id_len: int, /) -> bool: ...
    def skippy_scheduler_find(self, scheduler: _CData, id: _Chars, id_len: int, /) -> int: ...
    def skippy_scheduler_sequence(
        self, scheduler: _CData, slot: int, out_info: _CData, /
    ) -> bool: ...
    def skippy_scheduler_get_metrics(self, scheduler: _CData, /) -> _CData: ...
    def skippy_scheduler_active_slots(self, scheduler: _CData, out_count: _CData, /) -> _CData: ...
    def skippy_scheduler_waiting_slots(self, scheduler: _CData, out_count: _CData, /) -> _CData: ...
    def skippy_scheduler_component_used(
        self, scheduler: _CData, out_count: _CData, /
    ) -> _CData: ...
    def skippy_scheduler_retired(self, scheduler: _CData, out_count: _CData, /) -> _CData: ...
    def skippy_scheduler_waiting_turn(self, scheduler: _CData, /) -> int: ...
    def skippy_scheduler_mixed_viable(self, scheduler: _CData, /) -> bool: ...
    def skippy_scheduler_set_tenant_weight(
        self, scheduler: _CData, tenant: int, weight: float, out_error: _CData, /
    ) -> int: ...
    def skippy_scheduler_tenant_counter(self, scheduler: _CData, tenant: int, /) -> float: ...
    def skippy_scheduler_fair_share_lifts(self, scheduler: _CData, /) -> int: ...
