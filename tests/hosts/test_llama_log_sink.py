"""llama.cpp's log sink is C (`_llama_log`): it holds up under many threads logging at once,
from C threads and from llama.cpp itself, and keeps what an error message needs."""
from __future__ import annotations

import threading

import pytest

from skippy_scheduler import _llama_log


def test_c_threads_flooding_the_sink_leave_whole_lines_and_exact_counts():
    seen_before, kept_before = _llama_log.counts()
    threads, messages = 16, 3000
    assert _llama_log.flood(threads, messages) == threads
    seen, kept = _llama_log.counts()
    # Each thread logs levels 2, 3, 5, 4, 1 in turn (a NULL text in between is ignored): the
    # warnings, the errors and the continuation lines after a warning are kept.
    per_level = threads * messages // 5
    for level in (1, 2, 3, 4, 5):
        assert seen[level] - seen_before[level] == per_level
    assert kept - kept_before == 3 * per_level
    lines = _llama_log.recent(_llama_log.RING)
    assert len(lines) == _llama_log.RING
    for line in lines:
        # a line longer than the ring's slots is cut, not spilled into the next one
        assert line.startswith("t") and (line.endswith("\n") or
                                         len(line) == _llama_log.LINE - 1)
        head, _, body = line.partition(" x")
        tid, msg, level = head.split(" ")
        assert level in ("l3", "l4", "l5")
        # one thread's letter throughout: no line was written by two threads at once
        assert len(set(body.rstrip("\n"))) <= 1
        assert len(line) < _llama_log.LINE


def test_python_threads_calling_the_sink_through_ctypes_at_once():
    import ctypes

    sink = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)(
        _llama_log.sink_address())
    _, kept_before = _llama_log.counts()
    n, each = 8, 500

    def log(i: int) -> None:
        for k in range(each):
            sink(4, f"py{i} error {k}\n".encode(), None)  # ctypes releases the GIL here

    workers = [threading.Thread(target=log, args=(i,)) for i in range(n)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    _, kept = _llama_log.counts()
    assert kept - kept_before == n * each
    assert all(line.startswith("py") for line in _llama_log.recent(16))


def test_llama_cpp_logging_from_several_threads_goes_to_the_sink(tmp_path):
    pytest.importorskip("llama_cpp")
    pytest.importorskip("gguf")
    from skippy_scheduler.hosts.llama import backend
    from skippy_scheduler.hosts.tiny_model import write_tiny_llama

    backend.init_backend()
    good = write_tiny_llama(str(tmp_path / "tiny.gguf"), seed=0)
    import pathlib

    data = pathlib.Path(good).read_bytes()
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(data[: len(data) * 2 // 3])
    seen_before, _ = _llama_log.counts()
    errors: list[str] = []
    loaded: list[object] = []

    def load(path: str) -> None:
        for _ in range(3):
            try:
                loaded.append(backend.load_model(path))
            except RuntimeError as exc:
                errors.append(str(exc))

    # Loads of a whole and of a truncated model at once: llama.cpp logs its metadata dump and
    # its errors from every loading thread into the sink, with the GIL released.
    workers = [threading.Thread(target=load, args=(good if i % 2 else str(bad),))
               for i in range(6)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    import llama_cpp

    for model in loaded:
        llama_cpp.llama_model_free(model)
    seen, _ = _llama_log.counts()
    assert len(loaded) == 9 and len(errors) == 9
    assert sum(seen) - sum(seen_before) > 100  # the INFO dump of nine loads, at least
    assert all("could not load" in e and "cut.gguf" in e for e in errors)
    assert any("data is not within the file bounds" in e or "corrupted" in e for e in errors)


def test_a_failed_load_is_told_in_one_line_from_what_llama_cpp_logged():
    """The error of a context llama.cpp could not create names its last complaint and the
    allocation that failed before it, on one line (the command's `error:` line)."""
    import ctypes

    pytest.importorskip("llama_cpp")
    from skippy_scheduler.hosts.llama.backend import failure_reason, log_mark

    sink = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)(
        _llama_log.sink_address())
    sink(4, b"an older failure's error line\n", None)
    mark = log_mark()  # what this load logs comes after it
    for level, text in [
            (3, "llama_context: n_ctx_seq (4000000) > n_ctx_train (512)\n"),
            (4, "ggml_aligned_malloc: insufficient memory (attempted to allocate 39063 MB)\n"),
            (4, "graph_reserve: failed to allocate compute buffers\n"),
            (4, "llama_init_from_model: failed to initialize the context: failed to allocate "
                "compute pp buffers\n")]:
        sink(level, text.encode(), None)
    assert failure_reason(mark) == (
        "llama_init_from_model: failed to initialize the context: failed to allocate compute "
        "pp buffers (ggml_aligned_malloc: insufficient memory (attempted to allocate 39063 MB))")
    sink(4, b"llama_model_load: error loading model: tensor data is not within the file bounds\n",
         None)
    assert failure_reason(mark) == (
        "llama_model_load: error loading model: tensor data is not within the file bounds "
        "(ggml_aligned_malloc: insufficient memory (attempted to allocate 39063 MB))")
    assert failure_reason(log_mark()) == "no reason logged"
