"""A fault of a streamed answer's own (its producer raised, not the client leaving) cuts the
stream, which can no longer carry an error, and the server's log says what it was; the
request's lane is given back and the next request is answered."""
from __future__ import annotations

import logging

import httpx
import pytest
from serve_support import is_idle, start_server, wait_idle

from skippy_scheduler.serve import generation


@pytest.mark.parametrize("extra", [{}, {"logprobs": 1}, {"n": 2}],
                         ids=["plain", "logprobs", "choices"])
def test_a_producer_fault_is_logged_and_the_server_goes_on(model_path, monkeypatch, caplog,
                                                           extra):
    server = start_server(model_path)
    try:
        real = generation.Generation.feed
        calls = []

        def feed(self, events):
            calls.append(1)
            if len(calls) == 3:
                raise RuntimeError("an encoder fault")
            return real(self, events)

        monkeypatch.setattr(generation.Generation, "feed", feed)
        caplog.set_level(logging.ERROR, logger="skippy_scheduler.serve")
        lines: list[str] = []
        try:
            with httpx.stream("POST", server.url + "/v1/completions", timeout=60, json={
                    "prompt": "one two", "max_tokens": 40, "ignore_eos": True,
                    "stream": True, **extra}) as r:
                assert r.status_code == 200
                lines.extend(x for x in r.iter_lines() if x)
        except httpx.RemoteProtocolError:  # the body cut short
            pass
        assert "data: [DONE]" not in lines  # cut
        faults = [rec for rec in caplog.records if rec.exc_info is not None
                  and "an encoder fault" in str(rec.exc_info[1])]
        assert faults, [rec.getMessage() for rec in caplog.records]
        monkeypatch.setattr(generation.Generation, "feed", real)
        assert is_idle(wait_idle(server), server.host.n_seq_max)
        again = httpx.post(server.url + "/v1/completions", timeout=60,
                           json={"prompt": "one", "max_tokens": 3})
        assert again.status_code == 200, again.text
    finally:
        server.shutdown()
