from typing import Any

__pyx_capi__: dict[str, Any]  # the C functions other compiled modules cimport

def check_tokens_fast(name: str, values: object) -> list[int] | None: ...
