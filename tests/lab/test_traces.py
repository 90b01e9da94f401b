"""Trace importers: the shared public traces' published figures, token synthesis, streaming
and the errors a malformed file gets.

The public traces are looked up in $SKIPPY_TRACES_DIR, else in `<repository>/../shared/traces`;
the tests that need them are skipped when neither holds them.
"""
from __future__ import annotations

import functools
import math

import numpy as np
import pytest

from lab_support import TRACES
from skippy_scheduler.lab.traces import (BLOCK_TOKENS, MAX_TOKENS, TOKEN_MODULUS, Trace,
                                         TraceError, TraceFormatError, detect_format,
                                         open_trace, synthesize_prompt, tenant_of_id)

MOONCAKE_CONV = "mooncake-fast25-conversation_trace.jsonl"
MOONCAKE_SYNTH = "mooncake-fast25-synthetic_trace.jsonl"
AZURE_CODE = "AzureLLMInferenceTrace_code.csv"
AZURE_CONV = "AzureLLMInferenceTrace_conv.csv"


def shared(name: str) -> str:
    path = TRACES / name
    if not path.is_file():
        pytest.skip(f"public trace {name} not found in {TRACES} (set SKIPPY_TRACES_DIR to the "
                    "directory holding the shared traces)")
    return str(path)


@functools.lru_cache(maxsize=None)
def _load(name: str):
    trace = open_trace(str(TRACES / name))
    requests = list(trace)
    return trace, requests


def loaded(name: str):
    shared(name)
    return _load(name)


def lengths(requests):
    return (np.array([r.input_length for r in requests]),
            np.array([r.output_length for r in requests]))


def leading_seen(requests):
    """Per request: the number of leading block ids that appeared in an earlier request."""
    seen: set = set()
    out = []
    for r in requests:
        k = 0
        for b in r.blocks:
            if b not in seen:
                break
            k += 1
        out.append(k)
        seen.update(r.blocks)
    return np.array(out), len(seen)


def check_reuse(reqs, n_in, blocks, *, distinct, block_pct, token_pct, whole, histogram):
    """The published prefix-reuse figures of a Mooncake trace: distinct block ids, the share of
    blocks (and prompt tokens) in a leading run already seen, requests seen whole, and the
    histogram of leading-run lengths."""
    L, seen = leading_seen(reqs)
    assert seen == distinct
    assert 100 * L.sum() / blocks.sum() == pytest.approx(block_pct, abs=0.005)
    hit = np.minimum(BLOCK_TOKENS * L, n_in)
    assert 100 * hit.sum() / n_in.sum() == pytest.approx(token_pct, abs=0.005)
    assert int((L == blocks).sum()) == whole
    assert np.histogram(L, [0, 1, 2, 4, 8, 16, 32, 64, 128, 10**6])[0].tolist() == histogram
    return L


# -- the published figures (shared/traces/README.md) ---------------------------------------------


def test_mooncake_conversation_figures():
    trace, reqs = loaded(MOONCAKE_CONV)
    assert trace.format == "mooncake" and len(reqs) == 12_031
    assert trace.stats.rows == 12_031 and trace.stats.skipped_failures == 0
    times_ms = np.array([r.arrival_us for r in reqs]) / 1000
    assert times_ms[0] == 0 and times_ms[-1] == 3_536_999
    assert np.all(np.diff(times_ms) >= 0) and len(np.unique(times_ms)) == 1_180
    n_in, n_out = lengths(reqs)
    assert n_in.mean() == pytest.approx(12_035.1, abs=0.05)
    assert np.median(n_in) == 6_909 and np.percentile(n_in, 90) == 27_367
    assert np.percentile(n_in, 99) == pytest.approx(85_400, abs=0.5)
    assert (n_in.min(), n_in.max()) == (891, 126_195)
    assert n_out.mean() == pytest.approx(342.6, abs=0.05)
    assert np.median(n_out) == 350 and np.percentile(n_out, 90) == 597
    assert np.percentile(n_out, 99) == pytest.approx(1_118.5, abs=0.05)
    assert (n_out.min(), n_out.max()) == (1, 2_000)
    blocks = np.array([len(r.blocks) for r in reqs])
    # The importer refuses any other count; checked here on every row all the same.
    assert np.array_equal(blocks, [math.ceil(n / BLOCK_TOKENS) for n in n_in])
    assert blocks.sum() == 288_500
    check_reuse(reqs, n_in, blocks, distinct=182_790, block_pct=36.64, token_pct=37.36,
                whole=118, histogram=[1, 7_372, 896, 791, 1_104, 953, 651, 178, 85])


def test_mooncake_synthetic_figures():
    trace, reqs = loaded(MOONCAKE_SYNTH)
    assert len(reqs) == 3_993
    times_ms = np.array([r.arrival_us for r in reqs]) / 1000
    assert times_ms[-1] - times_ms[0] == 1_022_025
    assert len(np.unique(times_ms)) == 3_982
    gaps = np.diff(times_ms)
    assert gaps.mean() == pytest.approx(256, abs=0.5) and np.median(gaps) == 175
    n_in, n_out = lengths(reqs)
    assert n_in.mean() == pytest.approx(15_325.5, abs=0.05) and np.median(n_in) == 11_587
    assert np.percentile(n_in, 90) == pytest.approx(38_611.2, abs=0.05)
    assert np.percentile(n_in, 99) == pytest.approx(66_456.2, abs=0.05)
    assert (n_in.min(), n_in.max()) == (13, 191_378)
    assert n_out.mean() == pytest.approx(149.1, abs=0.05) and np.median(n_out) == 69
    assert np.percentile(n_out, 90) == 389
    assert np.percentile(n_out, 99) == pytest.approx(768.1, abs=0.05)
    blocks = np.array([len(r.blocks) for r in reqs])
    assert np.array_equal(blocks, [math.ceil(n / BLOCK_TOKENS) for n in n_in])
    assert blocks.sum() == 121_877 and np.median(blocks) == 23 and blocks.max() == 374
    L = check_reuse(reqs, n_in, blocks, distinct=43_924, block_pct=63.96, token_pct=65.12,
                    whole=213, histogram=[2_211, 34, 3, 217, 237, 269, 542, 443, 37])
    assert int((L > 0).sum()) == 1_782  # first id seen in an earlier row


def test_azure_code_figures():
    trace, reqs = loaded(AZURE_CODE)
    assert trace.format == "azure" and len(reqs) == 8_819
    t = np.array([r.arrival_us for r in reqs]) / 1e6
    assert t[-1] == pytest.approx(3_435.948056, abs=1e-9)  # 100 ns resolution kept
    gaps = np.diff(t)
    assert np.all(gaps > 0)
    assert gaps.mean() == pytest.approx(0.390, abs=5e-4)
    assert np.median(gaps) == pytest.approx(0.064, abs=5e-4)
    assert gaps.max() == pytest.approx(217.2, abs=0.05)
    n_in, n_out = lengths(reqs)
    assert n_in.mean() == pytest.approx(2_047.8, abs=0.05) and np.median(n_in) == 1_469
    assert np.percentile(n_in, 90) == pytest.approx(5_187.6, abs=0.05)
    assert np.percentile(n_in, 99) == 7_436
    assert (n_in.min(), n_in.max()) == (3, 7_437)
    assert n_out.mean() == pytest.approx(27.9, abs=0.05) and np.median(n_out) == 13
    assert np.percentile(n_out, 90) == 55
    assert np.percentile(n_out, 99) == pytest.approx(251.5, abs=0.05)
    assert (n_out.min(), n_out.max()) == (6, 1_899)


def test_azure_conversation_figures():
    trace, reqs = loaded(AZURE_CONV)
    assert len(reqs) == 19_366 and trace.count_rows() == 19_366
    t = np.array([r.arrival_us for r in reqs]) / 1e6
    # 18:15:46.6805900 -> 19:14:08.4025270
    assert t[-1] == pytest.approx(3_501.721937, abs=1e-9)
    gaps = np.diff(t)
    assert np.all(gaps > 0)
    assert gaps.mean() == pytest.approx(0.181, abs=5e-4)
    assert np.median(gaps) == pytest.approx(0.118, abs=5e-4)
    assert gaps.max() == pytest.approx(4.3, abs=0.05)
    n_in, n_out = lengths(reqs)
    assert n_in.mean() == pytest.approx(1_154.7, abs=0.05) and np.median(n_in) == 1_020
    assert np.percentile(n_in, 90) == pytest.approx(2_734.5, abs=0.05)
    assert np.percentile(n_in, 99) == 4_142 and (n_in.min(), n_in.max()) == (2, 14_050)
    assert n_out.mean() == pytest.approx(211.1, abs=0.05) and np.median(n_out) == 129
    assert np.percentile(n_out, 90) == 424 and np.percentile(n_out, 99) == 601
    assert (n_out.min(), n_out.max()) == (7, 1_000)
    # No prefix identity: every request has blocks of its own.
    assert len({b for r in reqs[:500] for b in r.blocks}) == sum(len(r.blocks) for r in reqs[:500])


def test_format_detection_on_the_shared_traces():
    assert detect_format(shared(MOONCAKE_CONV)) == "mooncake"
    assert detect_format(shared(AZURE_CONV)) == "azure"


# -- prompt tokens ---------------------------------------------------------------------------------


def test_tokens_follow_the_block_ids():
    _, reqs = loaded(MOONCAKE_CONV)
    first = {}
    for r in reqs[:400]:
        prompt = r.prompt_array()
        assert prompt.dtype == np.int32 and len(prompt) == r.input_length
        assert prompt.min() >= 0 and prompt.max() < TOKEN_MODULUS
        for k, b in enumerate(r.blocks):
            block = prompt[k * BLOCK_TOKENS:(k + 1) * BLOCK_TOKENS]
            if b in first:  # the same id is the same tokens wherever it appears
                assert np.array_equal(block, first[b][:len(block)])
            else:
                first[b] = block
        r.drop_prompt()
    # Token prefixes are exactly the id prefixes: the common token prefix of two requests
    # is 512 x their common leading ids (or the shorter prompt, when one is a prefix).
    for a, b in zip(reqs[:300], reqs[1:301]):
        common = 0
        for x, y in zip(a.blocks, b.blocks):
            if x != y:
                break
            common += 1
        pa, pb = a.prompt_array(), b.prompt_array()
        m = min(len(pa), len(pb))
        diff = np.flatnonzero(pa[:m] != pb[:m])
        lcp = int(diff[0]) if len(diff) else m
        assert lcp == min(common * BLOCK_TOKENS, m)


def test_synthesised_prompts_are_a_function_of_the_ids():
    a = synthesize_prompt([3, 7], 600)
    assert a.tolist()[:3] == [1536, 1537, 1538] and a[512] == 7 * 512 and len(a) == 600
    assert np.array_equal(synthesize_prompt([3, 9], 600)[:512], a[:512])
    assert synthesize_prompt([3, 9], 600)[512] != a[512]
    big = synthesize_prompt([10**9], 4)
    assert big.min() >= 0 and big.max() < TOKEN_MODULUS
    with pytest.raises(ValueError):
        synthesize_prompt([1], 513)


# -- small files written here ----------------------------------------------------------------------


def write(tmp_path, name: str, text: str, newline: str = "\n") -> str:
    path = tmp_path / name
    path.write_bytes(text.replace("\n", newline).encode("utf-8"))
    return str(path)


MOONCAKE = (
    '{"timestamp": 0, "input_length": 600, "output_length": 3, "hash_ids": [0, 1]}\n'
    '{"timestamp": 0, "input_length": 512, "output_length": 2, "hash_ids": [0]}\n'
    '{"timestamp": 1500, "input_length": 1100, "output_length": 1, "hash_ids": [0, 1, 2], '
    '"tenant": "acme"}\n')


def test_mooncake_rows_stream_as_requests(tmp_path):
    path = write(tmp_path, "m.jsonl", MOONCAKE)
    trace = open_trace(path)
    assert trace.format == "mooncake" and trace.count_rows() == 3
    reqs = list(trace)
    assert [r.id for r in reqs] == ["r0", "r1", "r2"]
    assert [r.arrival_us for r in reqs] == [0.0, 0.0, 1_500_000.0]
    assert [r.tenant for r in reqs] == [None, None, "acme"]
    assert [r.line for r in reqs] == [1, 2, 3]
    assert all(r._prompt is None for r in reqs)  # no tokens until asked for
    seq = reqs[2].to_sequence()
    assert len(seq.prompt_tokens) == 1100 and seq.max_tokens == 1
    assert seq.prompt_tokens[:600] == reqs[0].to_sequence().prompt_tokens
    assert trace.stats.as_dict()["input_tokens"] == 2212
    scaled = list(open_trace(path, time_scale=0.5, limit=3, tenants=4))
    assert scaled[2].arrival_us == 750_000.0
    assert [r.tenant for r in scaled] == [tenant_of_id(f"r{k}", 4) for k in range(3)]
    assert tenant_of_id("r0", 4) == tenant_of_id("r0", 4) and tenant_of_id("r0", 4)[0] == "t"
    assert len(list(open_trace(path, limit=2))) == 2


def test_reading_is_lazy(tmp_path):
    path = write(tmp_path, "m.jsonl", MOONCAKE + "not json at all\n")
    trace = iter(open_trace(path, format="mooncake"))
    assert [next(trace).id for _ in range(3)] == ["r0", "r1", "r2"]
    with pytest.raises(TraceFormatError):
        next(trace)


AZURE = ("TIMESTAMP,ContextTokens,GeneratedTokens\n"
         "2023-11-16 18:17:03.9799600,4808,10\n"
         "2023-11-16 18:17:04.0000001,700,2\n"
         "2023-11-16 18:18:03.9799600,3,1")


def test_azure_crlf_without_final_newline(tmp_path):
    path = write(tmp_path, "a.csv", AZURE, newline="\r\n")
    trace = open_trace(path)
    assert trace.format == "azure" and trace.count_rows() == 3
    reqs = list(trace)
    assert [r.arrival_us for r in reqs] == [0.0, pytest.approx(20_040.1, abs=1e-6), 60_000_000.0]
    assert [(r.input_length, r.output_length) for r in reqs] == [(4808, 10), (700, 2), (3, 1)]
    # Fresh block ids per request: no two prompts share a first token.
    firsts = {r.prompt_array()[0] for r in reqs}
    assert len(firsts) == 3
    assert [len(r.blocks) for r in reqs] == [10, 2, 1]


BURST = ("Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type,Session ID\n"
         "5,ChatGPT,472,18,490,Conversation log,s1\n"
         "7,GPT-4,1200,0,1200,Conversation log,s2\n"
         "9.5,ChatGPT,30,4,34,API log,s1\n")


def test_burstgpt_failures_are_skipped_and_counted(tmp_path):
    path = write(tmp_path, "b.csv", BURST)
    trace = open_trace(path)
    assert trace.format == "burstgpt"
    reqs = list(trace)
    assert [(r.id, r.arrival_us, r.tenant) for r in reqs] == [("r0", 0.0, "s1"),
                                                              ("r2", 4_500_000.0, "s1")]
    assert trace.stats.skipped_failures == 1 and trace.stats.rows == 3
    assert trace.stats.requests == 2 and trace.stats.tenants == {"s1"}
    plain = write(tmp_path, "b2.csv", "Timestamp,Model,Request tokens,Response tokens,"
                                      "Total tokens,Log Type\n1,ChatGPT,10,2,12,API log\n")
    assert [r.tenant for r in open_trace(plain, format="burstgpt")] == [None]


MALFORMED = [
    ("m.jsonl", '{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [0]}\n'
                '{"timestamp": 5, "input_length": 10, "output_length": 1\n', 2, "json"),
    ("m.jsonl", '{"timestamp": 0, "input_length": 10, "output_length": 1}\n', 1, "hash_ids"),
    ("m.jsonl", '{"timestamp": 0, "input_length": "10", "output_length": 1, "hash_ids": [0]}\n',
     1, "input_length"),
    ("m.jsonl", '{"timestamp": 0, "input_length": 1000, "output_length": 1, "hash_ids": [0]}\n',
     1, "hash_ids"),
    ("m.jsonl", '{"timestamp": 0, "input_length": 10, "output_length": 0, "hash_ids": [0]}\n',
     1, "output_length"),
    ("m.jsonl", '{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [-1]}\n',
     1, "hash_ids"),
    ("m.jsonl", '{"timestamp": 9, "input_length": 10, "output_length": 1, "hash_ids": [0]}\n'
                '{"timestamp": 3, "input_length": 10, "output_length": 1, "hash_ids": [1]}\n',
     2, "timestamp"),
    ("m.jsonl", '{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [0], '
                '"tenant": [1]}\n', 1, "tenant"),
    ("a.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.97,12,x\n",
     2, "GeneratedTokens"),
    ("a.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\nyesterday,12,3\n", 2, "TIMESTAMP"),
    ("a.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.97,12,3\n"
              "2023-11-16 18:17:04.1,12\n", 3, "row"),
    ("a.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-02-30 18:17:03.97,12,3\n",
     2, "TIMESTAMP"),
    ("b.csv", "Timestamp,Request tokens,Response tokens\nsoon,10,2\n", 2, "Timestamp"),
    ("b.csv", "Timestamp,Request tokens,Response tokens\n1,-4,2\n", 2, "Request tokens"),
    # Token counts above 2^24: a 2^32 output would not fit the scheduler's 32-bit counts, a
    # 2^32 input would be a 32 GiB prompt.
    ("m.jsonl", '{"timestamp": 0, "input_length": 10, "output_length": 4294967296, '
                '"hash_ids": [0]}\n', 1, "output_length"),
    ("m.jsonl", '{"timestamp": 0, "input_length": 10, "output_length": 16777217, '
                '"hash_ids": [0]}\n', 1, "output_length"),
    ("m.jsonl", '{"timestamp": 0, "input_length": 16777217, "output_length": 1, '
                '"hash_ids": [0]}\n', 1, "input_length"),
    ("a.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.97,4294967296,5\n",
     2, "ContextTokens"),
    ("a.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.97,12,4294967295\n",
     2, "GeneratedTokens"),
    ("b.csv", "Timestamp,Request tokens,Response tokens\n1,16777217,2\n", 2, "Request tokens"),
    ("b.csv", "Timestamp,Request tokens,Response tokens\n1,10,400000000\n", 2,
     "Response tokens"),
]


@pytest.mark.parametrize("name, text, line, field", MALFORMED,
                         ids=[f"{m[0]}:{m[3]}:{k}" for k, m in enumerate(MALFORMED)])
def test_a_malformed_line_names_file_line_and_field(tmp_path, name, text, line, field):
    path = write(tmp_path, name, text)
    with pytest.raises(TraceFormatError) as info:
        list(open_trace(path))
    error = info.value
    assert (error.path, error.line, error.field) == (path, line, field)
    assert str(error).startswith(f"{path}:{line}: {field}: ")


def test_token_counts_are_bounded_at_2_to_the_24(tmp_path):
    """The largest lengths a request may have are read; one more is refused, naming the bound."""
    assert MAX_TOKENS == 1 << 24
    ids = list(range(MAX_TOKENS // BLOCK_TOKENS))
    path = write(tmp_path, "m.jsonl", f'{{"timestamp": 0, "input_length": {MAX_TOKENS}, '
                                      f'"output_length": {MAX_TOKENS}, "hash_ids": {ids}}}\n')
    (request,) = open_trace(path)
    assert (request.input_length, request.output_length) == (MAX_TOKENS, MAX_TOKENS)
    path = write(tmp_path, "a.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n"
                                    f"2023-11-16 18:17:03.97,12,{MAX_TOKENS + 1}\n")
    with pytest.raises(TraceFormatError) as info:
        list(open_trace(path))
    assert str(info.value) == (f"{path}:2: GeneratedTokens: must be <= 16777216 (2^24 tokens, "
                               "more than any served context holds), got 16777217")


def test_unreadable_or_unknown_files(tmp_path):
    with pytest.raises(TraceError, match="trace file not found"):
        open_trace(str(tmp_path / "none.jsonl"))
    with pytest.raises(TraceError, match="not found"):
        open_trace(str(tmp_path / "none.jsonl"), format="azure")
    with pytest.raises(TraceError, match="is a directory"):
        open_trace(str(tmp_path))
    with pytest.raises(TraceError, match="empty trace file"):
        open_trace(write(tmp_path, "e.csv", ""))
    with pytest.raises(TraceError, match=r"e\.csv:1: unknown trace format"):
        open_trace(write(tmp_path, "e.csv", "a,b,c\n1,2,3\n"))
    with pytest.raises(TraceFormatError, match="header: missing column"):
        list(open_trace(write(tmp_path, "h.csv", "TIMESTAMP,Tokens\n1,2\n"), format="azure"))
    with pytest.raises(TraceError, match="unknown trace format 'xml'"):
        Trace(write(tmp_path, "x.csv", "a\n"), "xml")
    with pytest.raises(ValueError, match="time_scale"):
        open_trace(write(tmp_path, "m.jsonl", MOONCAKE), time_scale=0)
