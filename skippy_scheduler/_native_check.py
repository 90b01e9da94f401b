"""Import-time check that the compiled modules are present and belong to this package.

Two failures look alike from the outside (the compiled modules cannot be imported) but need
different fixes, so they get different errors: a source checkout imported by accident (Python
started in the repository root finds the uncompiled `skippy_scheduler/` folder before the
installed package) and an installation whose compiled modules are missing or from another
version of the package.
"""
import os
from importlib.machinery import EXTENSION_SUFFIXES

from ._version import PLAN_ABI_VERSION

# Every extension module the package builds; importing them all here means a partial build
# fails with one clear error instead of a confusing one deep inside a later import.
COMPILED_MODULES = ("_abi", "_boundary", "_core", "_radix", "_rank")


class NativeBuildMismatch(ImportError):
    """The compiled extension modules do not belong to this Python package."""


class SourceTreeImport(ImportError):
    """The package was imported from a source checkout that has no compiled modules."""


REBUILD_HINT = (
    "the compiled modules of skippy_scheduler do not match its Python sources; rebuild them "
    "with `pip install --force-reinstall --no-cache-dir .` from the source tree"
)


def _has_compiled_modules(package_dir: str) -> bool:
    try:
        names = set(os.listdir(package_dir))
    except OSError:
        return False
    return any(module + suffix in names for module in COMPILED_MODULES for suffix in EXTENSION_SUFFIXES)


def source_tree_without_build(package_dir: str) -> bool:
    """Whether `package_dir` is the package folder of a checkout that was never built in place.

    A checkout has the project's pyproject.toml one level up; an installed package never does.
    """
    checkout = os.path.dirname(package_dir)
    has_project = os.path.isfile(os.path.join(checkout, "pyproject.toml"))
    return has_project and not _has_compiled_modules(package_dir)


def source_tree_message(package_dir: str) -> str:
    return (
        f"imported the source tree at {package_dir}, which has no compiled modules; run Python "
        "from another directory to use the installed package, or build the checkout in place "
        f"with an editable install (`pip install -e .` in {os.path.dirname(package_dir)})"
    )


def check_native() -> None:
    try:
        from . import _boundary, _core, _radix, _rank  # noqa: F401
        from ._abi import lib as abi_lib
    except ImportError as exc:  # pragma: no cover - a source checkout or a broken install
        package_dir = os.path.dirname(os.path.abspath(__file__))
        if source_tree_without_build(package_dir):
            # The original error (a partially initialised module) would only mislead.
            raise SourceTreeImport(source_tree_message(package_dir)) from None
        raise NativeBuildMismatch(f"{REBUILD_HINT} ({exc})") from exc
    versions = {
        "skippy_scheduler._core": _core.PLAN_ABI_VERSION,
        "skippy_scheduler._abi": abi_lib.SKIPPY_PLAN_ABI_VERSION,
    }
    for module, version in versions.items():
        if version != PLAN_ABI_VERSION:
            raise NativeBuildMismatch(
                f"{module} implements plan ABI {version}, the package expects "
                f"{PLAN_ABI_VERSION}: {REBUILD_HINT}"
            )
