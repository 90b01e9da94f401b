"""Import-time check that the compiled modules match this package."""
from ._version import PLAN_ABI_VERSION

# Every extension module the package builds; importing them all here means a partial build
# fails with one clear error instead of a confusing one deep inside a later import.
COMPILED_MODULES = ("_abi", "_core", "_fast", "_radix", "_rank")


class NativeBuildMismatch(ImportError):
    """The compiled extension modules do not belong to this Python package."""


REBUILD_HINT = (
    "the compiled modules of skippy_scheduler do not match its Python sources; rebuild them "
    "with `pip install --force-reinstall --no-cache-dir .` from the source tree"
)


def check_native() -> None:
    try:
        from . import _abi, _core, _fast, _radix, _rank  # noqa: F401
    except ImportError as exc:  # pragma: no cover - exercised only on broken installs
        raise NativeBuildMismatch(f"{REBUILD_HINT} ({exc})") from exc
    versions = {
        "skippy_scheduler._core": _core.PLAN_ABI_VERSION,
        "skippy_scheduler._abi": _abi.lib.SKIPPY_PLAN_ABI_VERSION,
    }
    for module, version in versions.items():
        if version != PLAN_ABI_VERSION:
            raise NativeBuildMismatch(
                f"{module} implements plan ABI {version}, the package expects "
                f"{PLAN_ABI_VERSION}: {REBUILD_HINT}"
            )
