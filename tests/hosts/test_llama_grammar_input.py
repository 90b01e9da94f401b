"""What a grammar reads is checked before a request is queued (`LlamaHost.prepare_sequence`):
llama.cpp's grammar sampler ends the process (std::terminate) on a token it is fed that its
grammar refuses, so a grammar with `prompt_length` other than the prompt's (the prompt would
be fed to it) and tokens generated elsewhere that the grammar refuses end the request as
rejected, and the process and the requests beside it go on (a grammar that takes the end of
the prompt it is given runs). Each case runs in a process of its own: before the check, the
process died."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("llama_cpp")

SCRIPT = textwrap.dedent("""
    import sys
    from skippy_scheduler import Scheduler, SchedulerConfig
    from skippy_scheduler.engine import Engine, Request
    from skippy_scheduler.hosts.llama import LlamaHost
    from skippy_scheduler.hosts.tiny_model import write_tiny_llama
    from skippy_scheduler.sampling import OutputOptions, SamplingParams

    case, folder = sys.argv[1], sys.argv[2]
    path = write_tiny_llama(folder + "/tiny.gguf", seed=7)
    grammar = 'root ::= "ab"'
    with LlamaHost(path, n_ctx=512, n_seq_max=2, n_threads=1) as host:
        engine = Engine(Scheduler(SchedulerConfig(max_active_sequences=2,
                                                  max_tokens_per_iteration=64)), host)
        prompt = [1, 5, 6]
        if case == "prompt_length":  # 0: the prompt's <s> fed to a grammar that refuses it
            bad = Request("bad", prompt, 4, sampling=SamplingParams(
                temperature=0.0, output=OutputOptions(grammar=grammar)))
        elif case == "past":
            bad = Request("bad", prompt, 4, sampling=SamplingParams(
                temperature=0.0, output=OutputOptions(grammar=grammar, prompt_length=9)))
        elif case == "tail":  # the prompt's end read by a grammar that takes it: runs
            bad = Request("bad", prompt, 4, sampling=SamplingParams(
                temperature=0.0, output=OutputOptions(grammar='root ::= [^\\\\x00]*',
                                                      prompt_length=1)))
        else:  # tokens generated elsewhere, resumed here
            class Resumed(Request):
                def to_sequence(self):  # replayed from position 0, as after preemption
                    seq = super().to_sequence()
                    seq.generated_tokens = [7, 7]
                    return seq
            bad = Resumed("bad", prompt, 4, sampling=SamplingParams(
                temperature=0.0, output=OutputOptions(grammar=grammar,
                                                      prompt_length=len(prompt))))
        report = engine.run([bad, Request("ok", [1, 300, 301], 3)])
        for r in report.records:
            print(r.id, r.finish_reason)
        print("lanes", len(host.active_sequences), "samplers", host.host_state().samplers)
""")


@pytest.mark.parametrize("case", ["prompt_length", "past", "generated", "tail"])
def test_what_a_grammar_refuses_is_a_rejected_request_not_a_dead_process(tmp_path, case):
    done = subprocess.run([sys.executable, "-c", SCRIPT, case, str(tmp_path)],
                          capture_output=True, text=True, timeout=120, cwd=str(tmp_path))
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    if case == "tail":
        assert any(line.startswith("bad ") and line != "bad rejected" for line in lines), \
            done.stdout
    else:
        assert "bad rejected" in lines, done.stdout
    assert any(line.startswith("ok ") and line != "ok rejected" for line in lines), done.stdout
    assert "lanes 0 samplers 0" in lines
