"""One choice's output as it arrives: detokenised, cut at stop strings, timed, with the
log-probabilities the host reported (`TokenEvent.detail`)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional, Sequence

from ..engine import FinishEvent, TokenEvent
from ..sampling import TokenLogprob
from ..types import UNCOMPLETED_REASONS
from .text import Detokenizer, StopMatcher

if TYPE_CHECKING:  # pragma: no cover
    from .app import ServeContext
    from .protocol import GenerationRequest
    from .runner import Subscription


class Generation:
    """One engine request's output so far (a choice of the answer)."""

    def __init__(self, ctx: "ServeContext", sub: "Subscription", gen: "GenerationRequest",
                 prompt_tokens: int, index: int = 0, prompt: Sequence[int] = (),
                 echo: Optional[str] = None) -> None:
        self.ctx = ctx
        self.prompt = prompt  # the prompt's tokens
        self.echo = echo  # the text an echo puts before the completion (None: no echo)
        self.index = index  # the choice's index in the answer
        self.sub = sub
        self.request = gen
        self.prompt_tokens = prompt_tokens
        self.detok = Detokenizer(ctx.pieces)
        self.stop = StopMatcher(gen.stop)
        self.tokens: list[int] = []
        self.text: list[str] = []  # what a non-streamed answer collects
        self.finish: Optional[str] = None
        self.error: Optional[str] = None
        # Another choice of its answer failed, which ended the answer (a stream's one error
        # event): closed unfinished, but not because the client left.
        self.failed_beside = False
        self._last_us: Optional[float] = None
        # The SLO's inputs (serve/slo.py): TTFT and the largest gap so far, in µs; and the
        # key of its prompt's entry among those waiting for prefill until the first token
        # (`Slo.hold`; 0: none).
        self._ttft_us: Optional[float] = None
        self._max_gap_us = 0.0
        self.held = 0
        # Under best_of its verdict waits for the ranking (`judge_slo`): only the choices
        # returned are judged.
        self._verdict: Optional[tuple[Optional[float], Optional[float], Optional[float],
                                      float]] = None
        # Reports (only when the request asked for log-probabilities):
        self.logprobs: list[TokenLogprob] = []  # one per token of `tokens`
        self.offsets: list[int] = []  # each token's first character in the generated text
        self.prompt_logprobs: Optional[tuple[TokenLogprob, ...]] = None
        self.cumulative_logprob = 0.0
        self._chars = 0
        # A scored prompt (max_tokens 0, with echo): its first token ends it unanswered.
        self.scoring = gen.max_tokens == 0
        # A token of this request is only text: no stop strings or ids, no min_tokens.
        self._plain = (not gen.stop and not gen.stop_token_ids and gen.min_tokens == 0
                       and not self.scoring)

    @property
    def text_only(self) -> bool:
        """Its tokens are only text: a token event without a detail can end nothing (no stop
        strings or ids, no min_tokens), so `feed` takes it on its short path."""
        return self._plain

    def feed(self, events: list[Any]) -> tuple[str, list[int]]:
        """New text and token ids from `events`; sets `finish` (or `error`) at the end."""
        m = self.ctx.metrics
        parts: list[str] = []
        ids: list[int] = []
        plain = self._plain
        for event in events:
            if self.finish is not None:
                break  # tokens that raced a stop-string cancel are not the client's
            if plain and type(event) is TokenEvent and event.detail is None:
                # The common token: nothing but its text (the full path below, minus what
                # this request does not use: details, min_tokens, stop ids and strings).
                t = event.time_us
                last = self._last_us
                if last is None:
                    self._first(t)
                else:
                    gap = t - last if t > last else 0.0
                    m.itl.observe(gap / 1e6)
                    if gap > self._max_gap_us:
                        self._max_gap_us = gap
                self._last_us = t
                self.tokens.append(event.token)
                ids.append(event.token)
                piece = self.detok.add(event.token)
                self.offsets.append(self._chars)
                self._chars += len(piece)
                parts.append(piece)
                continue
            if isinstance(event, TokenEvent):
                if event.detail is not None:
                    self._report(event.detail, event.token >= 0 and not self.scoring)
                t = event.time_us
                if self.scoring:  # the prompt is scored: its first token is not answered
                    self._first(t)
                    self._end("length", t)
                    self.ctx.runner.cancel(self.sub.request_id)
                    continue
                if event.token < 0:  # the end signal, sent for its detail
                    if self._ttft_us is None:  # the first token sampled was the end token
                        self._first(t)
                    continue
                if self._last_us is None:
                    self._first(t)
                else:
                    gap = max(t - self._last_us, 0.0)
                    m.itl.observe(gap / 1e6)
                    if gap > self._max_gap_us:
                        self._max_gap_us = gap
                self._last_us = t
                held = len(self.tokens) < self.request.min_tokens  # (docs/fleet.md)
                self.tokens.append(event.token)
                ids.append(event.token)
                if event.token in self.request.stop_token_ids and not held:
                    parts.append(self._stop_token(event.token))
                    self._end("stop", t)
                    self.ctx.runner.cancel(self.sub.request_id)
                    continue
                piece = self.detok.add(event.token)
                self.offsets.append(self._chars)
                self._chars += len(piece)
                text, stopped = self.stop.push(piece, held=held)
                if stopped and self.request.include_stop_str_in_output:
                    text += self.stop.matched
                parts.append(text)
                if stopped:
                    self._end("stop", t)
                    self.ctx.runner.cancel(self.sub.request_id)
            elif isinstance(event, FinishEvent):
                if self.sub.error is not None or event.reason in UNCOMPLETED_REASONS:
                    self.error = self.sub.error or event.error or f"the request {event.reason}"
                    self.finish = "error"
                    continue
                if self._ttft_us is None:  # answered, with no token: the end came first
                    self._first(event.time_us)
                held = len(self.tokens) <= self.request.min_tokens  # the last token's text
                text, stopped = self.stop.push(self.detok.flush(), held=held)
                parts.append(text if stopped else text + self.stop.flush())
                self._end("stop" if stopped else event.reason, event.time_us)
        m.generation_tokens.inc(len(ids))
        return "".join(parts), ids

    def _first(self, t_us: float) -> None:
        """The first token came at `t_us`: TTFT observed, its prompt no longer waiting."""
        ttft = max(t_us - self.sub.arrival_us, 0.0)
        self._ttft_us = ttft
        self.ctx.metrics.observe_ttft(ttft / 1e6, self.request.priority)
        if self.held:
            self.release_hold(first_token=True)

    def release_hold(self, first_token: bool = False) -> None:
        """Its prompt no longer counts as waiting for prefill (at its first token, or when the
        answer closes before one)."""
        held, self.held = self.held, 0
        if held:
            self.ctx.slo.release(held, first_token)

    def _report(self, detail: Any, kept: bool) -> None:
        if detail.prompt is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = detail.prompt  # a replay after preemption reports it again
        if detail.logprob is not None and kept:  # not the end token's: it has no text
            self.logprobs.append(detail.logprob)
            self.cumulative_logprob += detail.logprob.logprob

    def _stop_token(self, token: int) -> str:
        """The text still owed when a stop token ends the generation (with the token's own
        text only under include_stop_str_in_output)."""
        self.offsets.append(self._chars)
        piece = self.detok.add(token) if self.request.include_stop_str_in_output else ""
        text, stopped = self.stop.push(piece + self.detok.flush())
        return text if stopped else text + self.stop.flush()

    def _end(self, reason: str, t_us: float) -> None:
        self.finish = reason
        m = self.ctx.metrics
        m.e2e.observe(max(t_us - self.sub.arrival_us, 0.0) / 1e6)
        m.request_success.labels(reason).inc()
        r = self.request
        if r.ttft_ms is not None or r.itl_ms is not None:  # its SLO's verdict (serve/slo.py)
            self._verdict = (r.ttft_ms, r.itl_ms,
                             None if self._ttft_us is None else self._ttft_us / 1e3,
                             self._max_gap_us / 1e3)

    def judge_slo(self) -> None:
        """Count its SLO verdict, once: when the answer it is a choice of went out whole (not
        at its own end: an answer that fails in another choice counts nowhere, and under
        best_of only the choices returned are judged)."""
        verdict, self._verdict = self._verdict, None
        if verdict is not None:
            self.ctx.slo.judge(self.sub.request_id, *verdict)

    def usage(self) -> dict[str, Any]:
        """OpenAI's usage of this choice: its prompt (counted by the answer's first choice of
        each prompt only), its tokens, and the prompt tokens its KV took from a kept prefix
        (`prompt_tokens_details.cached_tokens`, at most its prompt tokens)."""
        n = len(self.tokens)
        cached = min(self.sub.cached_tokens or 0, self.prompt_tokens)
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": n,
                "total_tokens": self.prompt_tokens + n,
                "prompt_tokens_details": {"cached_tokens": cached}}
