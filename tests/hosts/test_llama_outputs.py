"""The llama.cpp host's reports and constraints under real schedules: sequences that ask for
log-probabilities, prompt log-probabilities or a grammar, and choices of one prompt that the
host decodes once (forks), get the tokens they get alone, batched, chunked and preempted; every
kept token comes with its log-probability, equal to the alone run's logits."""
from __future__ import annotations

import json
import random

import numpy as np
import pytest

pytest.importorskip("llama_cpp")

from llama_cpp.llama_grammar import json_schema_to_gbnf  # noqa: E402

from skippy_scheduler import MemoryComponent, Scheduler, SchedulerConfig  # noqa: E402
from skippy_scheduler.cost_model import LAB_COST  # noqa: E402
from skippy_scheduler.engine import Engine, Request, TokenEvent, VirtualClock  # noqa: E402
from skippy_scheduler.hosts.llama import LlamaHost  # noqa: E402
from skippy_scheduler.hosts.tiny_model import write_tiny_llama  # noqa: E402
from skippy_scheduler.hosts.llama.samplers import MAX_GRAMMAR_DEPTH, grammar_depth  # noqa: E402
from skippy_scheduler.sampling import OutputOptions, SamplingParams  # noqa: E402

N_SEQ = 6
KV_BYTES = 10**9
GRAMMAR = json_schema_to_gbnf(json.dumps({
    "type": "object", "properties": {"ok": {"type": "boolean"},
                                     "c": {"enum": ["red", "green"]}},
    "required": ["ok", "c"], "additionalProperties": False}))


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("model") / "tiny-f32.gguf", seed=7)


@pytest.fixture(scope="module")
def host(model):
    with LlamaHost(model, n_ctx=N_SEQ * 512, n_seq_max=N_SEQ, n_batch=512, n_threads=1) as h:
        yield h


@pytest.fixture(scope="module")
def ahead_host(model):
    with LlamaHost(model, n_ctx=N_SEQ * 512, n_seq_max=N_SEQ, n_batch=512, n_threads=1,
                   stage_ahead=True) as h:
        yield h


def _sampling(rng: random.Random, kind: int, prompt_length: int) -> SamplingParams:
    if kind == 0:  # greedy, reporting
        return SamplingParams(temperature=0.0, output=OutputOptions(
            logprobs=2, prompt_logprobs=1, prompt_length=prompt_length))
    if kind == 1:  # a grammar, sampled, penalised (both stages see replays)
        return SamplingParams(temperature=1.0, seed=rng.randrange(1 << 40),
                              repetition_penalty=1.2, output=OutputOptions(
                                  grammar=GRAMMAR, logprobs=0, prompt_length=prompt_length))
    return SamplingParams(temperature=0.9, top_k=40, seed=rng.randrange(1 << 40),
                          output=OutputOptions(logprobs=1, prompt_length=prompt_length))


@pytest.mark.parametrize("depth,ahead", [(1, False), (2, False), (2, True)])
def test_reporting_and_constrained_sequences_match_alone_runs(request, depth, ahead):
    # (2, True): each plan staged while the one before decodes where it can be (not while a
    # fork's followers follow, nor while a prompt's log-probabilities are collected).
    host = request.getfixturevalue("ahead_host" if ahead else "host")
    staged = host.staged_ahead
    preempted = shared = 0
    for seed in range(8):
        rng = random.Random(500 + seed)
        requests = []
        for i in range(rng.randrange(3, 7)):
            prompt = [1] + [rng.randrange(3, 384) for _ in range(rng.randrange(1, 40))]
            sampling = _sampling(rng, i % 3, len(prompt))
            copies = rng.choice([1, 1, 3])  # three choices of one prompt: a fork
            for j in range(copies):
                s = sampling if j == 0 else SamplingParams(
                    temperature=sampling.temperature, top_k=sampling.top_k,
                    seed=(sampling.seed or 0) + j, output=sampling.output)
                requests.append(Request(f"s{i}.{j}", prompt, 24, arrival_us=0.0, sampling=s))
        scheduler = Scheduler(SchedulerConfig(
            max_active_sequences=N_SEQ, max_tokens_per_iteration=rng.choice([64, 512]),
            prefill_chunk_tokens=rng.choice([5, 256]), max_inflight_plans=depth,
            memory_components=[MemoryComponent("kv", KV_BYTES, 0, 1, 0)]))

        def pressure(engine):
            nonlocal preempted
            if rng.random() < 0.1:
                preempted += len(engine.preempt([KV_BYTES + 1]))
                engine.preempt([0])

        engine = Engine(scheduler, host, clock=VirtualClock(LAB_COST), before_step=pressure,
                        max_iterations=5000)
        events: dict[str, list[TokenEvent]] = {}
        engine.add_listener(lambda e: events.setdefault(e.request_id, []).append(e)
                            if isinstance(e, TokenEvent) else None)
        before = host.shared_tokens
        for req in requests:
            engine.submit(req)
        report = engine.run()
        shared += host.shared_tokens - before
        for req, res in zip(requests, report.records):
            alone = host.generate_alone(req.prompt_tokens, req.max_tokens, req.sampling)
            if res.finish_reason == "stop":
                assert res.tokens + [alone[len(res.tokens)]] == alone, (seed, req.id)
            else:
                assert res.tokens == alone, (seed, req.id)
            kept = [e for e in events.get(req.id, []) if e.token >= 0]
            assert [e.token for e in kept][-len(res.tokens):] == res.tokens
            assert all(e.detail is not None and e.detail.logprob is not None for e in kept)
            if req.sampling.output.grammar is not None and res.finish_reason == "stop":
                text = b"".join(host.token_bytes(t) for t in res.tokens).decode()
                assert set(json.loads(text)) == {"ok", "c"}
            if req.sampling.output.prompt_logprobs is not None:
                prompts = [e.detail.prompt for e in events[req.id] if e.detail.prompt]
                assert prompts and len(prompts[0]) == len(req.prompt_tokens) - 1
        assert host.active_sequences == [] and host.host_state().samplers == 0
    assert preempted > 3 and shared > 0
    assert (host.staged_ahead - staged > 10) == ahead


def test_logprobs_are_the_alone_runs_logits(host):
    """The reported figures are a log-softmax of the raw logits (before bias, temperature)."""
    prompt = [1, 373, 381, 356, 324, 343]
    params = SamplingParams(temperature=0.7, seed=4, logit_bias={300: 5.0},
                            output=OutputOptions(logprobs=3, prompt_length=len(prompt)))
    engine = Engine(Scheduler(SchedulerConfig(max_active_sequences=2,
                                              max_tokens_per_iteration=64)), host)
    events = []
    engine.add_listener(lambda e: events.append(e) if isinstance(e, TokenEvent) else None)
    engine.submit(Request("a", prompt, 5, sampling=params))
    engine.run()
    tokens = [e.token for e in events if e.token >= 0]
    seq = list(prompt)
    for event, token in zip(events, tokens):
        host.run_rows([("ref", seq, 0, True)])
        row = host.logits_of_batch_row(len(seq) - 1).astype(np.float64)
        host.release("ref")
        ref = row - (row.max() + np.log(np.exp(row - row.max()).sum()))
        assert abs(event.detail.logprob.logprob - ref[token]) < 1e-4
        assert [t for t, _ in event.detail.logprob.top] == np.argsort(-ref,
                                                                     kind="stable")[:3].tolist()
        seq.append(token)


def test_a_grammar_llama_cpp_cannot_parse_is_refused_and_the_others_run(host):
    """Refused by prepare_sequence (the request ends as rejected) rather than failing every
    plan it would be in, with the requests beside it."""
    bad = SamplingParams(temperature=0.0, output=OutputOptions(grammar="root ::= (",
                                                               prompt_length=2))
    good = SamplingParams(temperature=0.0, output=OutputOptions(logprobs=0, prompt_length=2))
    with pytest.raises(ValueError, match="grammar"):
        host.check_grammar("root ::= (")
    engine = Engine(Scheduler(SchedulerConfig(max_active_sequences=2,
                                              max_tokens_per_iteration=64)), host)
    report = engine.run([Request("ok", [1, 5], 3, sampling=good),
                         Request("bad", [1, 6], 3, sampling=bad)])
    got = {r.id: r.finish_reason for r in report.records}
    assert got["bad"] == "rejected" and got["ok"] in ("length", "stop")
    assert host.active_sequences == [] and host.host_state().samplers == 0


def test_a_grammar_nested_past_the_limit_is_refused_before_llama_cpp_reads_it(host):
    """llama.cpp parses groups by recursion: 30 000 inside one another overflowed the stack."""
    deep = "root ::= " + "(" * 30000 + '"a"' + ")" * 30000
    with pytest.raises(ValueError, match="nests 30000 groups"):
        host.check_grammar(deep)
    assert grammar_depth('root ::= ("(" [()] x)  # ((( ') == 1  # strings, classes, comments
    assert grammar_depth('root ::= # a comment ends at CR too\r(("a"))') == 2
    with pytest.raises(ValueError, match="rules, more than"):  # references followed by recursion
        host.check_grammar("root ::= r0\n" + "".join(f"r{i} ::= r{i + 1}\n" for i in range(20000))
                           + 'r20000 ::= "a"\n')
    host.check_grammar("root ::= " + "(" * MAX_GRAMMAR_DEPTH + '"a"' + ")" * MAX_GRAMMAR_DEPTH)
