"""The request-level rollout-engine contract (`RolloutEngine`) that the rollout strategies
implement (`vllm`, `hf_infer`), and the typed records it speaks in.

A request is one sampled response: `submit` takes an id, the prompt's token ids, its `Sampling`
and a seed; the engine runs it when driven (`step`, `wait`) and hands back a `RequestOutput`:
the token ids, their log-probs, the weight version that sampled each token, and why it ended.
`abort` ends requests early and returns what they had. A prompt's G responses are G requests
(seeds seed, seed + 1, ..., as vLLM gives its `n` children), submitted one after another under a
shared `group`, which an engine that batches by prompt (hf_infer) keeps together.

Weight versions: the worker passes the version of the weights it loads to
`finish_weight_update` (or `load_adapter`); the engine stamps each token it samples afterwards
with it. Updates run between engine steps (a Ray actor runs one call at a time), so a request in
flight across one carries tokens of both versions; that is what partial rollouts build on.

`generate_groups` is the batch call (G responses per prompt, submitted and waited for) that
the rollout worker and the strategies' own `generate` are thin wrappers of.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import (Any, Callable, Dict, Iterable, List, Literal, Optional, Protocol, Sequence, Tuple,
                    runtime_checkable)

from roll_gspo.schema.config import GeneratingArgs

FinishReason = Literal["stop", "length", "abort"]


@dataclass(frozen=True)
class Sampling:
    """How one request samples: vLLM's meaning for each field (top_k -1 or 0: off; temperature 0:
    greedy); `max_new_tokens` None leaves the engine's default."""

    max_new_tokens: Optional[int]
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1

    @classmethod
    def of(cls, gen: GeneratingArgs, max_new_tokens: Optional[int] = None) -> "Sampling":
        """The sampling of a role's `generating_args`, its cap replaced by `max_new_tokens` if given."""
        return cls(max_new_tokens=gen.max_new_tokens if max_new_tokens is None else max_new_tokens,
                   temperature=gen.temperature, top_p=gen.top_p, top_k=gen.top_k)


@dataclass
class RequestOutput:
    """What a request has produced: one entry per sampled token in `token_ids`, `log_probs` (the
    engine's log-prob of the token under the weights that sampled it) and `weight_versions`;
    `finish_reason` None while it runs, "stop" at a stop token, "length" at its cap, "abort"."""

    request_id: str
    token_ids: List[int] = field(default_factory=list)
    log_probs: List[float] = field(default_factory=list)
    weight_versions: List[int] = field(default_factory=list)
    finish_reason: Optional[FinishReason] = None
    submitted_version: int = 0  # the weights loaded at submit: the version of a request without tokens

    @property
    def finished(self) -> bool:
        """Ended, for whatever reason."""
        return self.finish_reason is not None

    @property
    def weight_version(self) -> int:
        """The oldest version among its tokens (what staleness is measured from)."""
        return min(self.weight_versions, default=self.submitted_version)


class RequestHandle:
    """A submitted request: `result()` drives its engine until it has finished."""

    def __init__(self, engine: "RolloutEngine", request_id: str):
        self.engine = engine
        self.request_id = request_id
        self._output: Optional[RequestOutput] = None

    def result(self) -> RequestOutput:
        """The finished output (collected from the engine once, kept here)."""
        if self._output is None:
            (self._output,) = self.engine.wait([self.request_id])
        return self._output


@runtime_checkable
class RolloutEngine(Protocol):
    """What a rollout rank needs of its engine. `VllmStrategy` (vLLM's LLMEngine, stepped) and
    `HfInferStrategy` (a queue run through transformers' `generate`, a batch per step) implement it.

    Requests: ids are the caller's and unique among those not yet collected; outputs stay with
    the engine until `wait` or `abort` returns them. Weight sync: one session per update,
    `begin_weight_update`, then `load_bucket` per bucket as it arrived (or `load_weights` with
    named tensors), then `finish_weight_update(version)`. Device routes of the sync:
    `weight_receivers`, `weight_gpus`, `join_weight_group`."""

    weight_version: int  # stamped on the tokens sampled from now on

    def submit(self, request_id: str, prompt_ids: Sequence[int], sampling: Sampling, seed: Optional[int] = None,
               group: Optional[str] = None) -> RequestHandle:
        """Queue one request. `seed`: its sampling depends on it alone (None: the engine's own
        RNG). `group`: requests sampled from one prompt, submitted one after another."""

    def step(self) -> List[str]:
        """Advance the engine once; returns the ids of the requests that finished in it."""

    def unfinished(self) -> List[str]:
        """Ids of the requests submitted and not yet finished."""

    def progress(self) -> Tuple[int, int]:
        """(engine steps so far, requests in flight), safe to read from another thread: what a
        health probe compares over time (a hung engine holds requests and takes no step)."""

    def wait(self, request_ids: Sequence[str]) -> List[RequestOutput]:
        """Step until these requests have finished; returns (and releases) their outputs, in order."""

    def abort(self, request_ids: Sequence[str]) -> List[RequestOutput]:
        """End these requests now; returns (and releases) what each has: tokens so far and
        finish_reason "abort" (a finished one as it finished)."""

    def score(self, prompt_ids: Sequence[Sequence[int]], response_ids: Sequence[Sequence[int]]) -> List[List[float]]:
        """The engine's log-probs of given responses (teacher forcing; no request may be in flight)."""

    def begin_weight_update(self) -> None:
        """Open a weight-update session."""

    def load_weights(self, named_tensors: List[Tuple[str, Any]]) -> None:
        """Load named tensors (checkpoint names) within the session."""

    def load_bucket(self, payload: Any, reader: Any) -> None:
        """Load one bucket as the trainer's sync sent it (shared memory, object store or
        collective; `reader`: the rank's `SharedSegmentReader`)."""

    def finish_weight_update(self, version: Optional[int] = None) -> None:
        """Close the session; tokens sampled from now on carry `version` (None: unchanged)."""

    def load_adapter(self, named_tensors: List[Tuple[str, Any]], config: Dict[str, Any],
                     version: Optional[int] = None) -> None:
        """`lora_sync: adapter`: apply the trainer's LoRA adapter from now on, stamped `version`."""

    def sleep(self) -> None:
        """Between phases on shared devices: free what the engine can."""

    def wake(self) -> None:
        """Undo `sleep` (submit and score wake the engine themselves)."""

    def weight_receivers(self) -> int:
        """Processes holding this engine's weights (one per tensor-parallel worker)."""

    def weight_gpus(self) -> List[Optional[str]]:
        """The GPU (UUID; None on CPU) of each of those processes."""

    def join_weight_group(self, host: str, port: int, first_rank: int, world_size: int, timeout_s: float,
                          backend: str, members: Optional[List[Optional[int]]] = None) -> None:
        """Join the weight-sync group (`weight_sync_transport: collective` or a device route)."""


class RequestTable:
    """The requests an engine holds, by id: their outputs so far, until collected. The
    bookkeeping `RolloutEngine`'s implementations share."""

    def __init__(self) -> None:
        self.outputs: Dict[str, RequestOutput] = {}
        self.live: set = set()  # ids not yet finished (checked every engine step: a set, not a scan)

    def add(self, request_id: str, version: int) -> RequestOutput:
        """A new request, submitted while weights `version` are loaded."""
        if request_id in self.outputs:
            raise ValueError(f"request id {request_id!r} is already in use (submitted and not yet collected)")
        output = self.outputs[request_id] = RequestOutput(request_id, submitted_version=version)
        self.live.add(request_id)
        return output

    def drop(self, request_id: str) -> None:
        """Forget a request the engine refused at submit."""
        self.outputs.pop(request_id, None)
        self.live.discard(request_id)

    def extend(self, request_id: str, token_ids: Sequence[int], log_probs: Sequence[float], version: int) -> None:
        """Tokens sampled for a request, all under weights `version`."""
        output = self.outputs[request_id]
        output.token_ids.extend(token_ids)
        output.log_probs.extend(log_probs)
        output.weight_versions.extend([version] * len(token_ids))

    def finish(self, request_id: str, reason: FinishReason) -> None:
        """The request has ended, for `reason`."""
        self.outputs[request_id].finish_reason = reason
        self.live.discard(request_id)

    def unfinished(self) -> List[str]:
        """Ids not yet finished, in submission order."""
        return [rid for rid in self.outputs if rid in self.live] if self.live else []

    def wait(self, request_ids: Sequence[str], step: Callable[[], List[str]]) -> List[RequestOutput]:
        """Call `step` (which returns the ids it finished) until every one of `request_ids` has
        finished, then release them."""
        missing = [rid for rid in request_ids if rid not in self.outputs]
        if missing:
            raise KeyError(f"unknown request ids (never submitted, or already collected): {missing[:5]}")
        waiting = self.live.intersection(request_ids)
        while waiting:
            waiting.difference_update(step())
        return [self.outputs.pop(rid) for rid in request_ids]

    def abort(self, request_ids: Iterable[str]) -> List[RequestOutput]:
        """Mark the unfinished ones aborted and release them all (unknown ids are skipped)."""
        taken = []
        for rid in request_ids:
            output = self.outputs.pop(rid, None)
            if output is not None:
                if rid in self.live:
                    output.finish_reason = "abort"
                    self.live.discard(rid)
                taken.append(output)
        return taken


_calls = itertools.count()


class TabledEngine:
    """What both engines do the same way with their `RequestTable` (`self.requests`): list the
    unfinished requests, and wait for some by stepping the engine (`self.step`); count the steps
    taken (`progress`, what a health probe reads from another thread)."""

    requests: RequestTable
    steps_taken = 0  # engine steps so far (each implementation's `step` counts itself)

    def progress(self) -> Tuple[int, int]:
        """(engine steps so far, requests in flight): a hung engine holds requests and takes no step."""
        return self.steps_taken, len(self.requests.live)

    def step(self) -> List[str]:
        raise NotImplementedError

    def unfinished(self) -> List[str]:
        return self.requests.unfinished()

    def wait(self, request_ids: Sequence[str]) -> List[RequestOutput]:
        return self.requests.wait(request_ids, self.step)


def generate_groups(engine: RolloutEngine, prompt_ids: Sequence[Sequence[int]], sampling: Sampling, n: int,
                    seeds: Optional[Sequence[int]] = None) -> List[List[RequestOutput]]:
    """Per prompt, `n` responses: request j of prompt i has seed seeds[i] + j (vLLM's seeds for
    its `n` children; None: unseeded), all submitted in prompt order, then waited for."""
    call = next(_calls)
    ids = [[f"g{call}-{i}-{j}" for j in range(n)] for i in range(len(prompt_ids))]
    for i, prompt in enumerate(prompt_ids):
        for j, request_id in enumerate(ids[i]):
            engine.submit(request_id, prompt, sampling, None if seeds is None else int(seeds[i]) + j,
                          group=f"g{call}-{i}")
    flat = engine.wait([rid for group in ids for rid in group])
    return [flat[i * n:(i + 1) * n] for i in range(len(prompt_ids))]


def as_samples(groups: List[List[RequestOutput]]) -> List[List[Tuple[List[int], List[float], bool]]]:
    """The strategies' `generate` shape: per prompt, (token ids, log-probs, finished-by-stop) per sample."""
    return [[(out.token_ids, out.log_probs, out.finish_reason == "stop") for out in group] for group in groups]
