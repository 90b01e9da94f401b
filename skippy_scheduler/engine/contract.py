"""The runtime seam: what the engine asks of a scheduler and of a host, in one file.

Three parties meet here (docs/architecture.md). A *scheduler* makes one `Plan` per step and
learns what ran from the plan's output block; a *host* runs plans (llama.cpp in this process,
a model split over stage processes that all execute the same plan, a replica behind a router,
the lab's model-free stand-ins); the `Engine` drives both and owns the request bookkeeping.

Everything that crosses is declared below as a `typing.Protocol`, and nothing else in the
package asks an object what it can do. A plan is a few flat arrays (tokens, positions, row
offsets, which rows sample, which rows are new, what each new row restored) plus the row owners'
ids and, for new rows, their `IterationWork`; the host answers in the plan's output block
(work index, token; a negative token ends the sequence). Those are plain shapes, so a stage host
can ship the arrays to its workers as they are and a replica can receive them encoded.

A host has two required verbs (`Host`) and optional capabilities, each a protocol of its own:

* `PrefixRestoringHost.prepare_sequence`: give a sequence its prefix restore at submit, or
  refuse one the host could never run (TypeError, ValueError: it ends as rejected).
* `ConfigCheckingHost.check_config`: refuse, when the engine is built, a scheduler config whose
  plans the host could not run (more lanes, more tokens than it has).
* `MemoryReportingHost.memory_used`: measured bytes per memory component after each step.
* `AsyncHost.execute_async`: start a plan and return a handle (plans in flight, §2.11).
* `ChainingHost.execute_after`: start a plan behind those started, its deferred inputs filled
  on the host's worker (plans in flight back to back).
* `PipelinedHost.pipeline_depth`: how many started plans it runs at once (a pipeline of stages).
* `PrefixHoldingHost.prefix_store`: a store of resident prefixes the scheduler reads restores
  from; its holder ids are the scheduler's reserved sequence ids.
* `PromptKeepingHost.keep_prompt`: keep a running sequence's computed prompt as a resident
  prefix now (the scheduler's cold prefix hold says whose, behaviour.md §2.3a).
* `ResettableHost.release_all`: drop every sequence at once (recovery after a failure).
* `StateReportingHost.host_state`: lanes, KV tokens and the other figures a server reports.
* `DetailReportingHost.sample_details`: what the host reported with an executed plan's samples
  (log-probabilities), carried to listeners in `TokenEvent.detail`.

`attach(host)` checks all of them once and returns `HostHooks`: the bound methods the engine
calls, None for what the host lacks. The contract is stable: hosts written against it (the lab's,
a stage host, a replica) keep working as the engine changes.

A scheduler (`SchedulerLike`) says what happened in what it returns, not in lists the engine
asks for afterwards: a plan names the sequences its admission preempted for priority
(`Plan.priority_victims`), a completion's `IterationTelemetry` the prompts the cold prefix hold
wants kept (`prompt_keeps`). Its one optional capability is `SlackRuleScheduler` (`set_clock`,
`step_cost`, `set_step_cost`: the slack rule's inputs), checked by `check_slack_scheduler` when
the engine runs that rule.

**The serving seam.** A fourth party, the HTTP server (serve/), asks a host for more than plans:
the model's vocabulary, its chat template, its limits. That is declared here too, by concern, so
the server never reads a host's internals and needs nothing of llama.cpp itself:

* `VocabularyHost`: `n_vocab`, `tokenize`, `token_bytes` (prompts in, text out);
* `ChatTemplateHost`: `chat_template`, the model's own template (or None);
* `ContextLimitsHost`: `n_batch`, `n_ctx`, `n_ctx_seq`, `sequence_id_settings` (what the
  server sizes its scheduler and its requests' bounds from);
* `ClosingHost`: `close`, once the server is done with it;
* `RoutesHost`: vocabulary and chat template, what the HTTP routes use (`ServeContext.host`);
* `ServingHost`: all of the above plus `Host`, what a `Server` runs on.

Optional capabilities of a served host, a protocol each:

* `GrammarCheckingHost.check_grammar`: refuse a grammar its sampler cannot parse before the
  request is queued (without it, the host's `prepare_sequence` is the only judge);
* `MemoryComponentsHost.memory_components`: the memory pools admission reserves bytes in;
* `PrefixEventsHost`: `prefix_store`, `watch_prefixes` and `held_tokens`, what the server's KV
  event publisher (serve/kv_events.py) announces the host's resident and running prefixes from;
* `InterruptibleHost`: `interrupt(reason)` ends a wait of the engine's thread inside the host
  from another thread, and `abandon()` stops what the host started without freeing what that
  thread may still use (a server stopping while a stage hangs).

`LlamaHost`, `StageHost` and the benchmarks' `InstantHost` are `ServingHost`s
(tests/typing/test_serving_seam.py checks them).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import (TYPE_CHECKING, Any, Callable, Iterable, Mapping, Optional, Protocol,
                    Sequence as _Seq, runtime_checkable)

import numpy.typing as npt

from ..slack import StepCost
from ..types import (IterationTelemetry, IterationWork, MemoryComponent, ReleaseReason,
                     SchedulerConfig, SchedulerMetrics, SchedulerSnapshot, Sequence)

if TYPE_CHECKING:  # pragma: no cover
    from ..prefix_store import PrefixStore, StoreEntry

__all__ = [
    "AsyncHost", "ChainingHost", "ConfigCheckingHost", "DetailReportingHost", "ExecutionHandle",
    "Host", "HostHooks", "HostState", "MemoryReportingHost", "PipelinedHost", "Plan",
    "PlanOutputs", "PrefixHoldingHost",
    "PrefixRestoringHost", "PromptKeepingHost", "ReleaseReason",
    "RequestLike", "ResettableHost", "SchedulerLike", "SlackRuleScheduler", "StateReportingHost",
    "attach", "check_scheduler", "check_slack_scheduler", "DecodeTimingHost", "HostOutOfMemory",
    # the serving seam
    "ChatTemplateHost", "ClosingHost", "ContextLimitsHost", "GrammarCheckingHost",
    "InterruptibleHost", "MemoryComponentsHost", "PrefixEventsHost", "PrefixWatcher",
    "RoutesHost", "ServingHost", "VocabularyHost",
]

Array = npt.NDArray[Any]


class PlanOutputs(Protocol):
    """The compact output block a host fills: entry k says row `request_indexes[k]` sampled
    `predicted_tokens[k]` (negative: the sequence ends, the token is not one of its tokens)."""

    @property
    def request_indexes(self) -> Array: ...
    @property
    def predicted_tokens(self) -> Array: ...
    count: int


class Plan(Protocol):
    """One iteration's rows as a host reads them (row index = work index)."""

    def __len__(self) -> int: ...
    @property
    def token_count(self) -> int: ...
    @property
    def prefill_positions(self) -> int: ...  # prefill and recompute tokens' positions, summed
    @property
    def admitted(self) -> int: ...
    @property
    def preempted(self) -> int: ...         # sequences this plan's admission preempted for
                                            # priority (§2.8a)
    @property
    def priority_victims(self) -> tuple[str, ...]: ...  # their ids, in the order chosen: the
    #                                         engine releases them before the plan runs
    @property
    def tokens(self) -> Array: ...          # int32, the arena of every row's input tokens
    @property
    def positions(self) -> Array: ...       # int32, one position per arena entry
    @property
    def row_offsets(self) -> Array: ...     # rows + 1 offsets into the arena
    @property
    def phases(self) -> Array: ...          # uint8 per row: IterationPhase values
    @property
    def sample_rows(self) -> Array: ...     # the work indexes that sample (one output each)
    @property
    def new_rows(self) -> Array: ...        # uint8 per row: 1 at a sequence's first row since
    #                                         admission (set its runtime state up there)
    @property
    def restored_tokens(self) -> Array: ... # per row: positions [0, n) a new row starts from
    @property
    def deferred_rows(self) -> Array: ...   # rows whose input is an in-flight plan's sample
    @property
    def sequence_ids(self) -> list[str]: ...
    @property
    def work(self) -> list[IterationWork]: ...  # built on first use: read it for new rows only
    @property
    def outputs(self) -> PlanOutputs: ...


@runtime_checkable
class RequestLike(Protocol):
    """What the engine takes as a request (`Request`, the lab's workload requests)."""

    @property
    def id(self) -> str: ...
    @property
    def arrival_us(self) -> Optional[float]: ...  # on the engine's clock; None: when submitted
    def to_sequence(self) -> Sequence: ...


class SchedulerLike(Protocol):
    """What the engine calls on a scheduler (`Scheduler` and `TwinScheduler` both are one).

    The plan arguments are the plans this scheduler made (each implementation takes its own
    plan type, hence `Any`)."""

    @property
    def config(self) -> SchedulerConfig: ...
    @property
    def prefix_store(self) -> Any: ...
    def attach_prefix_store(self, store: Any, *, prefill_cost_per_token: int = 1,
                            restore_cost_per_token: int = 0) -> None: ...
    def submit(self, seq: Sequence) -> None: ...
    def cancel(self, sequence_id: str) -> bool: ...
    def plan_iteration(self) -> Plan: ...
    def observe_iteration_duration(self, plan: Any, elapsed: float) -> None: ...
    def abort_iteration(self, plan: Any) -> None: ...
    def complete_iteration(self, plan: Any) -> IterationTelemetry: ...
    def preempt_for_component_pressure(self, used_bytes: Iterable[int]) -> list[str]: ...
    def metrics(self) -> SchedulerMetrics: ...
    def snapshot(self) -> SchedulerSnapshot: ...


@runtime_checkable
class SlackRuleScheduler(Protocol):
    """A scheduler's optional capability: the slack rule's inputs (docs/behaviour.md §2.13).

    Under `PlanningRule.SLACK` with a clock, the engine sets the scheduler's clock after each
    step and before each submit, and refits its cost model from the steps' durations
    (engine/cost_fit.py, `SlackFeed`); `check_slack_scheduler` checks it once, when the engine
    is built. `Scheduler` and `TwinScheduler` both have it."""

    def set_clock(self, now: float) -> None: ...  # seconds, any monotonic origin
    @property
    def step_cost(self) -> StepCost: ...  # the cost model the rule predicts steps with
    def set_step_cost(self, cost: StepCost) -> None: ...


@runtime_checkable
class Host(Protocol):
    """The two verbs every runtime has.

    `execute(plan)` runs the plan's rows and writes one output per sampling row into
    `plan.outputs` (then sets its `count`); a sampling row left without one fails its sequence.
    A new row (`plan.new_rows`) is where a sequence's runtime state starts: positions
    [0, `restored_tokens`) come from the row's `work[row].restore_holder` (or were left by the
    caller), and its `work[row].sampling` says how to sample it. What `execute` returns is
    ignored. An exception leaves the plan aborted (its rows are undone, nothing is lost).

    `release(sequence_id, reason)` frees what the runtime holds for a sequence. `FINISHED` may
    keep its KV as a resident prefix; `PREEMPTED` means it will be re-admitted later with a new
    row; `CANCELLED` and `FAILED` end it. Releasing an unknown id does nothing.
    """

    def execute(self, plan: Plan) -> object: ...
    def release(self, sequence_id: str, reason: ReleaseReason) -> object: ...


@runtime_checkable
class PrefixRestoringHost(Protocol):
    def prepare_sequence(self, sequence: Sequence) -> Sequence:
        """`sequence`, with a prefix restore and cache affinity for what the host holds; or
        TypeError / ValueError for a sequence the host could never run (a token outside its
        vocabulary, more positions than a lane holds), before the scheduler takes it: the
        engine ends the request as rejected (or raises to a submitter on its own thread)."""
        ...


@runtime_checkable
class MemoryReportingHost(Protocol):
    def memory_used(self) -> Optional[_Seq[int]]:
        """Measured bytes per configured memory component (config order), or None when
        nothing was measured this time; asked after every completion."""
        ...


class ExecutionHandle(Protocol):
    """What `execute_async` and `execute_after` return. A handle that is said done later than
    its execution ended (a worker holding it until the next plan launches) is an
    `inflight.StampedFuture`, whose `ended_ns` the engine charges the plan to."""

    def result(self) -> object:
        """Wait for the execution; re-raise what it raised."""
        ...


@runtime_checkable
class AsyncHost(Protocol):
    def execute_async(self, plan: Plan) -> ExecutionHandle:
        """Start `execute(plan)` and return at once. The host runs one plan at a time, in the
        order given; the engine releases nothing while an execution runs."""
        ...


@runtime_checkable
class ChainingHost(Protocol):
    def execute_after(self, plan: Plan, earlier: "list[Plan]") -> ExecutionHandle:
        """Start `plan` behind the plans already started (`execute_async`'s order: one at a
        time) and return at once; on its worker, once those have run, fill the plan's deferred
        inputs from `earlier` (the plans started before it and not yet completed by the
        engine: `inflight.resolve_deferred`) and run it. When an earlier plan's execution
        failed, raise without running it. With it the engine starts plan N+1 while N runs,
        so the device never waits for the engine between two steps."""
        ...

    def call_after(self, fn: Callable[[], object]) -> ExecutionHandle:
        """Run `fn()` on the worker behind the plans started and return at once: what needs
        the device idle between two plans (the engine's releases and prompt keeps, which it
        waits for, touching nothing else meanwhile)."""
        ...


@runtime_checkable
class PipelinedHost(Protocol):
    @property
    def pipeline_depth(self) -> int:
        """Plans the host runs at once, in the order started (a model split over P stage
        processes runs one plan per stage). Above 1, with `execute_async`, the engine starts a
        plan without waiting for the ones in flight when it has no deferred input (the
        scheduler's `disjoint_inflight_plans`), and releases sequences while plans run: the
        host applies a release after the plans already started."""
        ...


@runtime_checkable
class PrefixHoldingHost(Protocol):
    @property
    def prefix_store(self) -> Any:
        """The host's `PrefixStore` (or None: reuse off). The engine attaches it to the
        scheduler, which then reads restores from it; its holder ids must be the scheduler's
        reserved sequence ids."""
        ...


@runtime_checkable
class PromptKeepingHost(Protocol):
    def keep_prompt(self, sequence_id: str, tokens: int) -> bool:
        """Offer the first `tokens` positions of the running `sequence_id` (its computed
        prompt) to the prefix store now, as a release would; whether the prompt is resident
        afterwards (False when it holds fewer positions or none, or the store refused them).
        Called on the engine's thread while no plan executes, when a completion's telemetry
        names the sequence in `prompt_keeps` (a waiting sequence is held for that prompt)."""
        ...


@runtime_checkable
class ConfigCheckingHost(Protocol):
    def check_config(self, config: SchedulerConfig) -> None:
        """ValueError when a scheduler of `config` would make plans this host cannot run (more
        sequences at once than it has lanes, more tokens in one plan than its batch holds),
        naming the setting to change. Called once, when the engine is built, before the
        engine changes anything; reads the config only."""
        ...


@runtime_checkable
class ResettableHost(Protocol):
    def release_all(self) -> None:
        """Release every sequence the host holds (after a failure nothing else can undo)."""
        ...


class HostOutOfMemory(RuntimeError):
    """What a host raises when a step could not get the device memory it needs (llama.cpp's
    allocation failure). The step's work is lost like any failed step's (the engine releases
    every sequence), but the server answers the open requests 503 with Retry-After, not 500:
    the request was fine, the device was full, and the server stays up."""


@dataclass(frozen=True)
class HostState:
    """What a runtime holds right now, for a server's figures and leak checks."""

    lanes: int  # sequences it can run at once
    free_lanes: int  # lanes no sequence holds
    active: tuple[str, ...] = ()  # ids of the sequences holding a lane
    kv_tokens: int = 0  # KV positions the active sequences hold
    kv_capacity: int = 0  # KV cells in total (lanes, and prefix holders if any)
    # KV cells the lanes may hold together, prefix holders' evictable cells left out (0: as
    # kv_capacity): what a usage of 1 means for a router, the lanes full.
    kv_lane_capacity: int = 0
    samplers: int = 0  # per-sequence sampler states alive
    decoded_tokens: int = 0  # batch entries decoded so far (a fork's copied rows not included)
    shared_tokens: int = 0  # batch entries a fork's KV copy replaced instead of a decode
    kv_copies: int = 0  # KV copies between runtime sequence ids so far (prefix keeps, restores)
    staged_ahead: int = 0  # plans staged while the plan before them ran on the device so far
    # Plans that ran after another without such a staging, by why (a host's own reasons;
    # the llama.cpp host's are `hosts.llama.host.NOT_STAGED_REASONS`).
    not_staged_ahead: Mapping[str, int] = field(default_factory=dict)
    # Highest KV position held per runtime sequence id that holds any (lanes only): must be
    # empty when no sequence is active.
    lane_positions: Mapping[int, int] = field(default_factory=dict)

    @property
    def lane_cells(self) -> int:
        """`kv_lane_capacity`, or `kv_capacity` from a host that does not tell them apart."""
        return self.kv_lane_capacity or self.kv_capacity


@runtime_checkable
class StateReportingHost(Protocol):
    def host_state(self, detail: bool = False) -> HostState:
        """The host's figures now (called on the engine's thread, between steps); `detail`
        asks for the figures that cost more to read (`lane_positions`), for leak checks."""
        ...


@runtime_checkable
class DecodeTimingHost(Protocol):
    @property
    def decode_ns(self) -> int:
        """Nanoseconds the host has spent inside the model's forward pass so far (a running
        total: a step's share is the difference), for the step timer (engine/step_timing.py)."""
        ...


@runtime_checkable
class DetailReportingHost(Protocol):
    def sample_details(self, plan: Plan) -> Optional[Mapping[int, Any]]:
        """What the host reported with `plan`'s samples, by work index (a `SampleDetail`
        each), or None; taken once, after the plan executed (the host forgets it then)."""
        ...


@dataclass(frozen=True)
class HostHooks:
    """A host's optional capabilities, resolved once by `attach` (None: not provided). The
    required verbs are called on the host itself (`host.execute`, `host.release`)."""

    prepare_sequence: Any = None
    memory_used: Any = None
    execute_async: Any = None
    prefix_store: Any = None
    release_all: Any = None
    host_state: Any = None
    sample_details: Any = None
    keep_prompt: Any = None
    pipeline_depth: int = 1  # plans it runs at once (PipelinedHost; 1 without execute_async)
    execute_after: Any = None  # ChainingHost (only with execute_async and depth 1)
    call_after: Any = None  # ChainingHost, with execute_after
    check_config: Any = None  # ConfigCheckingHost


_HOST_VERBS = ("execute", "release")
_SCHEDULER_VERBS = ("plan_iteration", "complete_iteration", "abort_iteration", "submit", "cancel",
                    "observe_iteration_duration", "preempt_for_component_pressure",
                    "attach_prefix_store", "metrics", "snapshot", "config", "prefix_store")


def attach(host: object) -> HostHooks:
    """Check `host` against the contract once; TypeError names the required verbs it lacks."""
    if not isinstance(host, Host):
        raise TypeError(f"{type(host).__name__} is not a host: it lacks "
                        f"{_missing(host, _HOST_VERBS)}")
    run_async = host.execute_async if isinstance(host, AsyncHost) else None
    depth = 1
    if run_async is not None and isinstance(host, PipelinedHost):
        depth = int(host.pipeline_depth)
        if depth < 1:
            raise ValueError(f"{type(host).__name__}.pipeline_depth must be >= 1, got {depth}")
    chain = host if run_async is not None and depth == 1 and isinstance(host, ChainingHost) \
        else None
    return HostHooks(
        execute_after=chain.execute_after if chain is not None else None,
        call_after=chain.call_after if chain is not None else None,
        prepare_sequence=host.prepare_sequence if isinstance(host, PrefixRestoringHost) else None,
        memory_used=host.memory_used if isinstance(host, MemoryReportingHost) else None,
        execute_async=run_async, pipeline_depth=depth,
        prefix_store=host.prefix_store if isinstance(host, PrefixHoldingHost) else None,
        release_all=host.release_all if isinstance(host, ResettableHost) else None,
        host_state=host.host_state if isinstance(host, StateReportingHost) else None,
        sample_details=(host.sample_details if isinstance(host, DetailReportingHost)
                        else None),
        keep_prompt=host.keep_prompt if isinstance(host, PromptKeepingHost) else None,
        check_config=host.check_config if isinstance(host, ConfigCheckingHost) else None,
    )


@runtime_checkable
class _SchedulerCheck(SchedulerLike, Protocol):
    pass


def check_scheduler(scheduler: object) -> SchedulerLike:
    """`scheduler` itself; TypeError unless it has everything `SchedulerLike` declares."""
    if not isinstance(scheduler, _SchedulerCheck):
        raise TypeError(f"{type(scheduler).__name__} is not a scheduler: it lacks "
                        f"{_missing(scheduler, _SCHEDULER_VERBS)}")
    return scheduler


_SLACK_VERBS = ("set_clock", "step_cost", "set_step_cost")


def check_slack_scheduler(scheduler: object) -> SlackRuleScheduler:
    """`scheduler` itself; TypeError unless it takes the slack rule's inputs
    (`SlackRuleScheduler`)."""
    if not isinstance(scheduler, SlackRuleScheduler):
        raise TypeError(f"{type(scheduler).__name__} cannot run the slack rule: it lacks "
                        f"{_missing(scheduler, _SLACK_VERBS)}")
    return scheduler


def _missing(obj: object, names: tuple[str, ...]) -> str:
    have = set(dir(obj))
    return ", ".join(n for n in names if n not in have)


def attach_store(scheduler: SchedulerLike, store: Any, config: SchedulerConfig) -> None:
    """A host that keeps resident prefixes hands its store to the scheduler, which then reads
    restores from it (§2.12). Its holder ids must be the scheduler's reserved sequence ids."""
    if scheduler.prefix_store is store:
        return
    holders = store.holder_slots
    if holders:
        limit = config.sequence_id_limit
        reserved = config.reserved_sequence_ids
        first = store.first_holder_id
        if holders > reserved or first != limit - reserved or first + holders > limit:
            raise ValueError(
                f"the host's prefix holders are sequence ids [{first}, {first + holders}) but the "
                f"scheduler reserves [{limit - reserved}, {limit}): configure the scheduler with "
                "the host's sequence_id_settings")
    scheduler.attach_prefix_store(store)


# -- the serving seam: what the HTTP server asks of a host ----------------------------------------


@runtime_checkable
class VocabularyHost(Protocol):
    """The model's vocabulary. Every verb reads only the vocabulary, so the server calls them
    from its event loop and worker threads while the engine runs plans on its own."""

    @property
    def n_vocab(self) -> int: ...  # token ids are [0, n_vocab)

    def tokenize(self, text: str, *, add_bos: Optional[bool] = None,
                 special: bool = False) -> list[int]:
        """`text`'s tokens; a start token as the model asks for one (`add_bos` None) or as
        `add_bos` says. `special` reads control-token text (a chat template's markers) as
        those tokens."""
        ...

    def token_bytes(self, token: int, *, special: bool = False) -> bytes:
        """The bytes `token` stands for (a piece may end inside a UTF-8 character); a
        control token's are empty unless `special`."""
        ...


@runtime_checkable
class ChatTemplateHost(Protocol):
    def chat_template(self) -> Optional[str]:
        """The model's own chat template (a GGUF's `tokenizer.chat_template`), or None: the
        server then renders chats as ChatML (serve/chat.py)."""
        ...


@runtime_checkable
class ContextLimitsHost(Protocol):
    """What the server sizes its scheduler and its requests' bounds from."""

    @property
    def n_batch(self) -> int: ...  # the most tokens one plan may hold (what the context got)
    @property
    def n_ctx(self) -> int: ...  # KV cells in all
    @property
    def n_ctx_seq(self) -> int: ...  # KV cells one sequence may hold

    @property
    def sequence_id_settings(self) -> Mapping[str, int]:
        """The `SchedulerConfig` fields that match the host's runtime sequence ids
        (`sequence_id_limit`, `reserved_sequence_ids`: the prefix holders' ids), which a
        scheduler reading restores from the host's `prefix_store` must be given."""
        ...


@runtime_checkable
class ClosingHost(Protocol):
    def close(self) -> None:
        """Free what the host holds (a model, a context, workers); the last call it gets."""
        ...


@runtime_checkable
class RoutesHost(VocabularyHost, ChatTemplateHost, Protocol):
    """What the HTTP routes ask of a host (`serve.app.ServeContext.host`)."""


@runtime_checkable
class ServingHost(Host, RoutesHost, ContextLimitsHost, ClosingHost, Protocol):
    """What a server runs on: the engine's two verbs, the routes' vocabulary and template, the
    limits it is sized from, and `close`."""


@runtime_checkable
class GrammarCheckingHost(Protocol):
    def check_grammar(self, grammar: str) -> None:
        """ValueError unless the host's grammar sampler parses `grammar` (GBNF, root rule
        `root`); reads only the vocabulary (any thread). Without this capability a request's
        grammar is judged by the host's `prepare_sequence` alone."""
        ...


@runtime_checkable
class MemoryComponentsHost(Protocol):
    @property
    def memory_components(self) -> list[MemoryComponent]:
        """The memory pools admission reserves bytes in (config order): the server gives them
        to its scheduler (`SchedulerConfig.memory_components`) and refuses a request that
        could never fit one."""
        ...


@runtime_checkable
class InterruptibleHost(Protocol):
    def interrupt(self, reason: str) -> None:
        """From any thread: a wait of the engine's thread inside the host ends soon after with
        an error of `reason`, and every later one at once. Only sets a flag."""
        ...

    def abandon(self) -> None:
        """Stop what the host started (worker processes) without freeing what the engine's
        thread may still be using: what a server does when that thread did not stop."""
        ...


PrefixWatcher = Callable[[str, "StoreEntry"], None]


@runtime_checkable
class PrefixEventsHost(Protocol):
    """What a server's KV event publisher (serve/kv_events.py) needs: the resident prefixes,
    word of every change to them, and what a running sequence's KV holds. Called on the
    engine's thread (or before the engine starts)."""

    @property
    def prefix_store(self) -> Optional["PrefixStore"]: ...  # None: the host keeps no prefixes

    def watch_prefixes(self, watcher: PrefixWatcher) -> None:
        """Call `watcher("inserted" | "evicted", entry)` after every change of the prefix
        store's residency (nothing happens without a store)."""
        ...

    def held_tokens(self, sequence_id: str) -> Optional[list[int]]:
        """The tokens the KV of running `sequence_id` stands for, position 0 first; None when
        it holds no lane (or the host keeps no record of its tokens: no prefix store)."""
        ...
