"""The shared structs have one layout in C, cffi and Cython, and the runtime's 72-byte request-row layout."""
import math
import os
import re
import shutil
import subprocess

import pytest

import skippy_scheduler
from skippy_scheduler import _core
from skippy_scheduler._abi import ffi, lib
from skippy_scheduler import IterationPhase, SequenceStatus
from skippy_scheduler.policies import AdmissionKind, PreemptionKind

# skippy_iteration_request offsets of the Skippy runtime ABI (LP64; docs/hosts.md).
SPEC_REQUEST = {
    "session": 0, "token_ids": 8, "token_count": 16, "positions": 24, "position_count": 32,
    "sampling": 40, "input_desc": 48, "input_payload": 56, "sample_last": 64,
}

LAYOUT = _core._layout()


def _c_layout(tmp_path):
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    lines = ['#include <stdio.h>', '#include <stddef.h>', '#include "skippy_scheduler.h"',
             "int main(void) {"]
    for struct, (_, fields) in LAYOUT.items():
        lines.append(f'printf("{struct} size %zu align %zu\\n", sizeof({struct}), _Alignof({struct}));')
        for f in fields:
            lines.append(f'printf("{struct} {f} %zu\\n", offsetof({struct}, {f}));')
    lines.append("return 0; }")
    src = tmp_path / "layout.c"
    src.write_text("\n".join(lines))
    exe = tmp_path / "layout"
    subprocess.run([cc, "-std=c11", "-I", skippy_scheduler.get_include(), str(src), "-o", str(exe)],
                   check=True)
    out = {}
    for line in subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout.splitlines():
        parts = line.split()
        if parts[1] == "size":
            out[(parts[0], "__size__")] = int(parts[2])
            out[(parts[0], "__align__")] = int(parts[4])
        else:
            out[(parts[0], parts[1])] = int(parts[2])
    return out


def test_request_row_matches_the_spec_everywhere(tmp_path):
    size, fields = LAYOUT["skippy_iteration_request"]
    assert size == 72
    assert fields == SPEC_REQUEST
    assert ffi.sizeof("skippy_iteration_request") == 72
    assert ffi.alignof("skippy_iteration_request") == 8
    for name, off in SPEC_REQUEST.items():
        assert ffi.offsetof("skippy_iteration_request", name) == off
    c = _c_layout(tmp_path)
    assert c[("skippy_iteration_request", "__size__")] == 72
    assert c[("skippy_iteration_request", "__align__")] == 8
    for name, off in SPEC_REQUEST.items():
        assert c[("skippy_iteration_request", name)] == off


def test_every_shared_struct_agrees_across_c_cffi_and_cython(tmp_path):
    c = _c_layout(tmp_path)
    for struct, (size, fields) in LAYOUT.items():
        assert ffi.sizeof(struct) == size == c[(struct, "__size__")], struct
        for name, off in fields.items():
            assert ffi.offsetof(struct, name) == off == c[(struct, name)], (struct, name)


def test_sampling_config_has_the_0_1_52_layout():
    assert ffi.sizeof("skippy_sampling_config") == 2352
    assert ffi.alignof("skippy_sampling_config") == 4
    for name, off in {"version": 0, "temperature": 20, "logit_bias_count": 40,
                      "dry_allowed_length": 72, "samplers": 104, "ignore_eos": 168,
                      "dry_sequence_breakers": 176, "logit_bias": 304}.items():
        assert ffi.offsetof("skippy_sampling_config", name) == off
    assert LAYOUT["skippy_sampling_config"][0] == 2352


def test_step_cost_appends_the_row_and_position_costs(tmp_path):
    """skippy_step_cost: the four coefficients where they were, per_prefill_row_us after them,
    then per_prefill_position_us."""
    expected = {"base_us": 0, "per_prefill_token_us": 8, "decode_base_us": 16,
                "per_decode_row_us": 24, "per_prefill_row_us": 32, "per_prefill_position_us": 40}
    assert LAYOUT["skippy_step_cost"] == (48, expected)
    assert ffi.sizeof("skippy_step_cost") == 48
    c = _c_layout(tmp_path)
    assert c[("skippy_step_cost", "__size__")] == 48
    for name, off in expected.items():
        assert ffi.offsetof("skippy_step_cost", name) == off == c[("skippy_step_cost", name)]


def test_scheduler_config_appends_the_prefill_age_bound_and_the_first_token_hold(tmp_path):
    """skippy_scheduler_config: slack_prefill_age_max_us after the cold prefix hold's fields,
    then slack_first_token_hold last; the C defaults are 2 s and off."""
    size, fields = LAYOUT["skippy_scheduler_config"]
    age = fields["slack_prefill_age_max_us"]
    hold = fields["slack_first_token_hold"]
    assert age == fields["cold_prefix_hold_max_steps"] + 8
    assert hold == age + 8
    assert size == hold + 8 == ffi.sizeof("skippy_scheduler_config")  # padded to 8
    c = _c_layout(tmp_path)
    assert c[("skippy_scheduler_config", "slack_prefill_age_max_us")] == age
    assert c[("skippy_scheduler_config", "slack_first_token_hold")] == hold
    assert c[("skippy_scheduler_config", "__size__")] == size
    config = ffi.new("skippy_scheduler_config *")
    lib.skippy_scheduler_config_default(config)
    assert config.slack_prefill_age_max_us == 2_000_000.0
    assert config.slack_first_token_hold is False


def test_error_and_version_structs():
    assert ffi.sizeof("skippy_error") == 16
    assert ffi.sizeof("skippy_version") == 12
    v = ffi.new("skippy_version *")
    assert ffi.sizeof(v[0]) == 12


def test_headers_and_library_are_installed():
    inc = skippy_scheduler.get_include()
    for h in ("skippy_abi.h", "skippy_abi_decls.h", "skippy_scheduler.h", "skippy_scheduler_decls.h"):
        assert os.path.isfile(os.path.join(inc, h))
    assert os.path.isfile(os.path.join(skippy_scheduler.get_library_dir(), "libskippy_scheduler_core.a"))


@pytest.mark.skipif(shutil.which("nm") is None, reason="needs binutils' nm")
def test_the_archive_defines_only_its_own_prefixes():
    """docs/api.md: a host linking the static core meets no name outside skippy_ and sk_."""
    archive = os.path.join(skippy_scheduler.get_library_dir(), "libskippy_scheduler_core.a")
    out = subprocess.run(["nm", "-g", "--defined-only", archive], capture_output=True,
                         text=True, check=True).stdout
    names = [f[2] for f in (line.split() for line in out.splitlines()) if len(f) == 3]
    assert len(names) > 50 and any(n.startswith("skippy_scheduler_plan") for n in names)
    assert [n for n in names if not n.startswith(("skippy_", "sk_"))] == []


def test_compiled_modules_carry_the_package_plan_abi():
    from skippy_scheduler._version import PLAN_ABI_VERSION
    from skippy_scheduler import _abi

    assert _core.PLAN_ABI_VERSION == PLAN_ABI_VERSION == _abi.lib.SKIPPY_PLAN_ABI_VERSION
    v = _abi.lib.skippy_scheduler_abi_version()
    assert (v.major, v.minor, v.patch) == (0, 1, 52)


def _header_enum(prefix):
    """Members and values of the headers' enum whose constants start with `prefix`."""
    text = ""
    for name in ("skippy_abi_decls.h", "skippy_scheduler_decls.h"):
        with open(os.path.join(skippy_scheduler.get_include(), name)) as f:
            text += f.read()
    return {name: int(value) for name, value in re.findall(rf"\b({prefix}\w+) = (\d+)", text)}


def _compiled_constants(tmp_path, names):
    """The values the C compiler gives the named constants of skippy_scheduler.h."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    src = tmp_path / "constants.c"
    lines = ['#include <stdio.h>', '#include "skippy_scheduler.h"', "int main(void) {"]
    lines += [f'printf("{n} %d\\n", (int){n});' for n in names]
    src.write_text("\n".join(lines + ["return 0; }"]))
    exe = tmp_path / "constants"
    subprocess.run([cc, "-std=c11", "-I", skippy_scheduler.get_include(), str(src), "-o", str(exe)],
                   check=True)
    out = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout
    return {name: int(value) for name, value in (line.split() for line in out.splitlines())}


@pytest.mark.parametrize("kind,prefix", [(AdmissionKind, "SKIPPY_ADMISSION_"),
                                         (PreemptionKind, "SKIPPY_PREEMPT_"),
                                         (IterationPhase, "SKIPPY_PHASE_"),
                                         (SequenceStatus, "SKIPPY_SEQ_")])
def test_policy_kinds_mirror_the_c_header(tmp_path, kind, prefix):
    mirror = {prefix + member.name: member.value for member in kind}
    assert _header_enum(prefix) == mirror  # same members, same values
    assert _compiled_constants(tmp_path, list(mirror)) == mirror
    assert {name: getattr(lib, name) for name in mirror} == mirror


@pytest.mark.parametrize("bad", [-1.0, math.nan, math.inf])
def test_c_refuses_a_bad_prefill_age_bound(bad):
    """The core checks the bound itself (finite, >= 0), with a message naming it."""
    config = ffi.new("skippy_scheduler_config *")
    lib.skippy_scheduler_config_default(config)
    config.slack_prefill_age_max_us = bad
    out = ffi.new("skippy_scheduler **")
    error = ffi.new("skippy_error **")
    assert lib.skippy_scheduler_create(config, out, error) == lib.SKIPPY_STATUS_INVALID_ARGUMENT
    assert out[0] == ffi.NULL
    assert b"slack_prefill_age_max_us" in ffi.string(error[0].message)
    lib.skippy_scheduler_error_free(error[0])
