"""Playing many episodes at once: environments step while the rollout engine generates.

Each episode is a small state machine: reset -> (generate a turn -> step the env -> append the
observation's ids) until the env ends it, the turn cap or the token budget. The loop keeps every
episode in flight, its turns sent to the rollout engine one of two ways:

- continuous (`run(..., submit=...)`, what the agentic pipeline uses): each episode's turn is one
  request, submitted the moment its env step returns and awaited on its own; the rank's engine loop
  (roll_gspo.strategies.engine_loop) adds it to the running batch at the next engine step, so a slow
  env step or a long turn holds back no other episode. `play` is its loop over given trajectories
  and envs, so that episodes can stop between turns and go on in a later call; its `gate` decides
  which turns a call plays (the episode pool of `async_generation_ratio` k >= 2,
  roll_gspo.agentic.episode_pool, cuts there).
- waves (`run(specs, generate, ...)`): the turns of all episodes that are ready go to the engine in
  one call, and while that call runs the environments of the episodes from the previous call step
  in threads. A call is sent as soon as the engine is free and no env step is outstanding, or when
  the ready ones have waited `batch_window_s` for slow env steps. Kept for callers that generate in
  batches of their own (the warm start's scripted policy) and as the benchmark's baseline.

Both give the same trajectories: a turn's tokens depend on its seed (`turn_seed`) and its context
alone, never on which other turns share the engine's batch (vLLM and hf_infer sample each seeded
request from a generator of its own), so the episodes' order of arrival changes nothing but timing.

Env calls run in daemon threads with a deadline: one that raises, returns a malformed result or
does not return within `env_step_timeout_s` ends its episode (counted, logged, the step's reward
the env's penalty), never the run. A stuck call is interrupted with an asynchronous exception and
abandoned (Python cannot kill a thread blocked in C code: it is left to finish on its own; code run
by the Python tool is killed by its sandbox at the tool's own timeout).
"""
from __future__ import annotations

import ctypes
import dataclasses
import logging
import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from roll_gspo.agentic.tokens import ChatStitcher
from roll_gspo.agentic.trajectory import EpisodeSpec, Trajectory
from roll_gspo.schema.config import CustomEnvConfig

logger = logging.getLogger("roll_gspo.agentic")
MAX_ENV_THREADS = 64


@dataclasses.dataclass
class TurnRequest:
    index: int  # the episode's position in the batch
    prompt_ids: List[int]  # the whole context so far
    max_new_tokens: int
    seed: int


@dataclasses.dataclass
class TurnOutput:
    ids: List[int]
    log_probs: List[float]
    weight_version: int = 0


GenerateFn = Callable[[List[TurnRequest]], List[TurnOutput]]
SubmitFn = Callable[[TurnRequest], "Future[TurnOutput]"]  # one turn, awaited on its own


@dataclasses.dataclass(frozen=True)
class EpisodeProgress:
    """An episode within one `EpisodeRunner.play` call: the turns it has submitted in the call, and
    whether it has ended, is ready for its next turn (waiting for the gate) or has a reset, turn or
    env step in flight (busy)."""
    turns: int
    state: str  # "ended" | "ready" | "busy"


# play's gate: the progress of every episode -> ((episode index, round) -> True / False / None); see `play`.
TurnGate = Callable[[Dict[int, EpisodeProgress]], Callable[[int, int], Optional[bool]]]


@dataclasses.dataclass
class EnvSetup:
    """One custom_envs entry, ready to build envs: `make(seed)` returns a fresh env."""
    tag: str
    config: CustomEnvConfig
    make: Callable[[int], Any]
    error_penalty: float = 0.0


class EnvCallError(Exception):
    """An env call that raised, hung or returned something malformed."""

    def __init__(self, message: str, timed_out: bool = False):
        super().__init__(message)
        self.timed_out = timed_out


class _EnvCall:
    """One env call in a daemon thread (a hung call must not keep the driver from exiting)."""

    def __init__(self, fn: Callable[[], Any], timeout_s: float, gate: threading.Semaphore):
        self.future: Future = Future()
        self.deadline = time.monotonic() + timeout_s
        self.timeout_s = timeout_s
        self.thread_id: Optional[int] = None
        self._gate = gate
        threading.Thread(target=self._run, args=(fn,), daemon=True, name="roll-gspo-env").start()

    def _run(self, fn: Callable[[], Any]) -> None:
        with self._gate:
            self.thread_id = threading.get_ident()
            self.deadline = time.monotonic() + self.timeout_s  # from when it runs, not when it queued
            try:
                result = fn()
            except BaseException as exc:  # noqa: BLE001 - an env's failure is reported, never raised here
                if not self.future.done():
                    self.future.set_exception(exc)
                return
            if not self.future.done():
                self.future.set_result(result)

    def expire(self) -> None:
        """Past the deadline: fail the call and interrupt its thread (at its next Python bytecode)."""
        if self.future.done():
            return
        self.future.set_exception(EnvCallError(f"no result within env_step_timeout_s = {self.timeout_s:g}",
                                               timed_out=True))
        if self.thread_id is not None:
            ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(self.thread_id),
                                                       ctypes.py_object(TimeoutError))


def format_turn(template: str, observation: str, turn_idx: int, actions_left: int, max_response_length: int,
                suffix: str = "") -> str:
    """A user turn from the agent template (ROLL's placeholders; unknown ones stay as written)."""
    values = {"observation": observation, "turn_idx": turn_idx, "actions_left": actions_left,
              "max_response_length": max_response_length, "suffix": suffix}
    try:
        return template.format(**values)
    except (KeyError, IndexError, ValueError):
        return template.format_map(_Keep(values))


class _Keep(dict):
    def __missing__(self, key: str) -> str:
        return "{" + key + "}"


class EpisodeRunner:
    """Plays a batch of episodes (`run`) against the envs of `setups` with one rollout engine."""

    def __init__(self, stitcher: ChatStitcher, setups: Dict[str, EnvSetup], *, sequence_length: int,
                 max_new_tokens: int, threads: int = 0, batch_window_s: float = 0.05):
        self.stitcher = stitcher
        self.setups = setups
        self.sequence_length = sequence_length
        self.max_new_tokens = max_new_tokens
        self.gate = threading.Semaphore(threads if threads > 0 else MAX_ENV_THREADS)
        self.batch_window_s = batch_window_s
        self.errors_logged: set = set()

    # -- the loop -----------------------------------------------------------------------------------
    def run(self, specs: Sequence[EpisodeSpec], generate: Optional[GenerateFn],
            turn_seed: Callable[[int, int], int], *, submit: Optional[SubmitFn] = None) -> List[Trajectory]:
        """Every episode of `specs`, played to its end, its turns sent by `submit` (continuous: one
        request per turn, see the module docstring) or else in waves by `generate`. `turn_seed(index,
        turn)`: the sampling seed of an episode's turn (a function of the step, so a resumed run
        samples what an uninterrupted one does). Returns the trajectories in `specs` order."""
        if submit is not None:
            return self._run_continuous(specs, submit, turn_seed)
        if generate is None:
            raise ValueError("EpisodeRunner.run needs `generate` (waves) or `submit` (continuous)")
        trajectories = [Trajectory(spec) for spec in specs]
        envs: Dict[int, Any] = {}
        env_calls: Dict[int, _EnvCall] = {}  # episode index -> its outstanding reset / step
        for t in trajectories:
            env_calls[t.spec.index] = self._call(t, lambda t=t: self._reset(t, envs))
        ready: List[Trajectory] = []
        ready_since: Optional[float] = None
        generation: Optional[Tuple[Future, List[Trajectory]]] = None
        by_index = {t.spec.index: t for t in trajectories}
        engine = _Engine(generate)
        try:
            while env_calls or ready or generation is not None:
                if generation is None and ready and (not env_calls or time.monotonic() - ready_since
                                                     >= self.batch_window_s):
                    batch, ready, ready_since = self._requests(ready, turn_seed), [], None
                    if batch[1]:
                        generation = (engine.submit(batch[0]), batch[1])
                    continue
                waiting = [c.future for c in env_calls.values()] + ([generation[0]] if generation else [])
                timeout = self._wait_timeout(env_calls, ready_since)
                wait(waiting, timeout=timeout, return_when=FIRST_COMPLETED)
                for call in env_calls.values():
                    if time.monotonic() > call.deadline:
                        call.expire()
                for index in [i for i, c in env_calls.items() if c.future.done()]:
                    call = env_calls.pop(index)
                    t = by_index[index]
                    self._after_env_call(t, call.future, envs)
                    if not t.done:
                        ready.append(t)
                        ready_since = ready_since or time.monotonic()
                if generation is not None and generation[0].done():
                    outputs, waiting_trajs = generation[0].result(), generation[1]
                    generation = None
                    for t, out in zip(waiting_trajs, outputs):
                        self._after_turn(t, out)
                        env_calls[t.spec.index] = self._call(t, lambda t=t, out=out: self._step(t, envs, out))
        finally:
            engine.close()
        return trajectories

    def _run_continuous(self, specs: Sequence[EpisodeSpec], submit: SubmitFn,
                        turn_seed: Callable[[int, int], int]) -> List[Trajectory]:
        """`run` with one request per turn, submitted as soon as the episode is ready."""
        trajectories = [Trajectory(spec) for spec in specs]
        self.play(trajectories, {}, submit, turn_seed)
        return trajectories

    def play(self, trajectories: Sequence[Trajectory], envs: Dict[int, Any], submit: SubmitFn,
             turn_seed: Callable[[int, int], int], gate: Optional[TurnGate] = None) -> Dict[int, int]:
        """Continue `trajectories` with one request per turn (continuous): an episode without an
        env in `envs` (keyed by spec.index) starts with a reset, one with an env (held from an
        earlier call, its env stepped after its last turn) with its next turn; ended ones are
        skipped. `envs` is updated in place (an ended episode's env is dropped). `gate(progress)`
        (None: every turn starts at once) decides whether an episode's next turn is played in this
        call: it returns, for an episode's index and the turn's round (its ordinal among the
        episode's turns of this call), True (play it), False (not in this call) or None (not known
        yet: the episode waits). The
        call returns when nothing is in flight and no turn may start; the episodes not ended are
        then ready for their next turn. Returns the turns each episode played (by index)."""
        by_index = {t.spec.index: t for t in trajectories}
        played = {index: 0 for index in by_index}
        env_calls: Dict[int, _EnvCall] = {}  # episode index -> its outstanding reset / step
        turns: Dict[int, Future] = {}  # episode index -> its turn in flight
        ready: Dict[int, TurnRequest] = {}  # episode index -> its next turn, waiting for the gate
        for t in trajectories:
            if t.done:
                continue
            if t.spec.index in envs:
                self._ready(t, ready, envs, turn_seed)
            else:
                env_calls[t.spec.index] = self._call(t, lambda t=t: self._reset(t, envs))
        while True:
            if ready:
                decide = gate(self._progress(by_index, played, ready)) if gate is not None else None
                for index in sorted(ready):
                    if decide is None or decide(index, played[index] + 1):
                        turns[index] = submit(ready.pop(index))
                        played[index] += 1
            if not env_calls and not turns:
                break
            waiting = [c.future for c in env_calls.values()] + list(turns.values())
            wait(waiting, timeout=self._wait_timeout(env_calls, None), return_when=FIRST_COMPLETED)
            for call in env_calls.values():
                if time.monotonic() > call.deadline:
                    call.expire()
            for index in sorted(i for i, c in env_calls.items() if c.future.done()):
                t = by_index[index]
                self._after_env_call(t, env_calls.pop(index).future, envs)
                if not t.done:
                    self._ready(t, ready, envs, turn_seed)
            for index in sorted(i for i, f in turns.items() if f.done()):
                t, out = by_index[index], turns.pop(index).result()  # an engine failure ends the run, as in waves
                self._after_turn(t, out)
                env_calls[index] = self._call(t, lambda t=t, out=out: self._step(t, envs, out))
        if ready and gate is not None:  # with nothing in flight every round is decided
            decide = gate(self._progress(by_index, played, ready))
            undecided = [i for i in ready if decide(i, played[i] + 1) is None]
            if undecided:
                raise RuntimeError(f"the turn gate left episodes {undecided} undecided with nothing in flight")
        return played

    def _ready(self, t: Trajectory, ready: Dict[int, TurnRequest], envs: Dict[int, Any],
               turn_seed: Callable[[int, int], int]) -> None:
        """The episode's next turn, waiting to be submitted (none: it ends, max_length, its env dropped)."""
        request = self._request(t, turn_seed)
        if request is not None:
            ready[t.spec.index] = request
        else:
            envs.pop(t.spec.index, None)

    @staticmethod
    def _progress(by_index: Dict[int, Trajectory], played: Dict[int, int],
                  ready: Dict[int, TurnRequest]) -> Dict[int, EpisodeProgress]:
        return {index: EpisodeProgress(played[index], "ended" if t.done else "ready" if index in ready else "busy")
                for index, t in by_index.items()}

    def _wait_timeout(self, env_calls: Dict[int, _EnvCall], ready_since: Optional[float]) -> float:
        now = time.monotonic()
        timeouts = [max(c.deadline - now, 0.0) + 0.01 for c in env_calls.values()]
        if ready_since is not None:
            timeouts.append(max(self.batch_window_s - (now - ready_since), 0.0) + 0.001)
        return min(timeouts) if timeouts else 0.1

    def _call(self, t: Trajectory, fn: Callable[[], Any]) -> _EnvCall:
        return _EnvCall(fn, self.setups[t.spec.tag].config.env_step_timeout_s, self.gate)

    def _requests(self, ready: List[Trajectory], turn_seed) -> Tuple[List[TurnRequest], List[Trajectory]]:
        requests, kept = [], []
        for t in sorted(ready, key=lambda t: t.spec.index):  # a call's order never depends on timing
            request = self._request(t, turn_seed)
            if request is not None:
                requests.append(request)
                kept.append(t)
        return requests, kept

    def _request(self, t: Trajectory, turn_seed) -> Optional[TurnRequest]:
        """The episode's next turn; None (the episode ends, max_length) when no token fits."""
        cap = min(self.setups[t.spec.tag].config.max_tokens_per_step, self.max_new_tokens,
                  self.sequence_length - t.length)
        if cap < 1:
            t.stop_reason = "max_length"
            return None
        return TurnRequest(t.spec.index, t.context_ids(), cap, turn_seed(t.spec.index, t.turns))

    def replay(self, t: Trajectory) -> Any:
        """A fresh env of the episode's seed, reset and stepped with its actions so far (the text of
        its assistant turns): the env of a held episode again, where envs are deterministic given
        their seed and the actions (the built-in and GEM-style ones are). The rewards must come
        back as recorded and the episode must not end; else a ValueError naming the env."""
        setup = self.setups[t.spec.tag]
        rewards: List[float] = []
        ended = False
        try:
            env = setup.make(t.spec.env_seed)
            _check_reset(env.reset(seed=t.spec.env_seed))
            for action in [m["content"] for m in t.messages if m["role"] == "assistant"]:
                _, reward, terminated, truncated, _ = _check_step(env.step(action))
                rewards.append(reward)
                ended = terminated or truncated
                if ended:
                    break
        except Exception as exc:  # noqa: BLE001 - named below, with the episode
            raise ValueError(f"env {t.spec.tag!r} ({setup.config.env_type}) failed while replaying a held episode "
                             f"from seed {t.spec.env_seed}: {type(exc).__name__}: {exc}") from exc
        if ended or rewards != t.step_rewards:
            raise ValueError(f"env {t.spec.tag!r} ({setup.config.env_type}) replayed from seed {t.spec.env_seed} and "
                             f"the episode's {len(rewards)} actions gave rewards {rewards}"
                             f"{' and ended' if ended else ''}, recorded {t.step_rewards} (not ended): it is not "
                             f"deterministic given its seed and actions, so an episode held in flight by a "
                             f"checkpoint cannot be continued (async_generation_ratio >= 2 resumes them by replay): "
                             f"train this env with async_generation_ratio 0 or 1, which hold no episode in flight")
        return env

    # -- one episode's transitions ------------------------------------------------------------------
    def _reset(self, t: Trajectory, envs: Dict[int, Any]) -> Tuple[str, dict]:
        env = self.setups[t.spec.tag].make(t.spec.env_seed)
        envs[t.spec.index] = env
        return env.reset(seed=t.spec.env_seed)

    def _step(self, t: Trajectory, envs: Dict[int, Any], out: TurnOutput):
        text = self.stitcher.tokenizer.decode(out.ids, skip_special_tokens=True)
        t.messages.append({"role": "assistant", "content": text})
        return envs[t.spec.index].step(text)

    def _after_env_call(self, t: Trajectory, future: Future, envs: Dict[int, Any]) -> None:
        setup = self.setups[t.spec.tag]
        try:
            result = future.result()
            if not t.prompt_ids and t.turns == 0 and not t.messages:
                observation, info = _check_reset(result)
                self._open(t, observation, info or {})
                if t.done:  # its opening does not fit: it never starts
                    envs.pop(t.spec.index, None)
                return
            observation, reward, terminated, truncated, info = _check_step(result)
        except BaseException as exc:  # noqa: BLE001 - the episode ends; the run goes on
            self._fail(t, exc, setup)
            envs.pop(t.spec.index, None)
            return
        info = info or {}
        t.step_rewards.append(float(reward))
        t.invalid_actions += int(info.get("action_is_valid", True) is False)
        if info.get("use_tool"):
            t.tool_calls += 1
            t.tool_errors += int(bool(info.get("tool_error")))
        for name, value in (info.get("metrics") or {}).items():
            if isinstance(value, (int, float)):
                t.env_metrics[name] = float(value)
        if terminated or truncated or t.turns >= setup.config.max_steps:
            t.success = bool(info.get("success", False))
            t.stop_reason = "terminated" if terminated else "truncated" if truncated else "max_turns"
            envs.pop(t.spec.index, None)
            return
        if info.get("use_tool"):
            message = {"role": "tool", "content": observation}
        else:
            message = {"role": "user", "content": self._user_turn(t, observation, info)}
        finished = self.stitcher.turn_finished(t.response_ids[-1:]) if t.response_ids else True
        ids = self.stitcher.suffix_ids([message], finished, self._system(setup))
        if t.length + len(ids) >= self.sequence_length:
            t.stop_reason = "max_length"
            envs.pop(t.spec.index, None)
            return
        t.messages.append(message)
        t.append_context(ids)

    def _open(self, t: Trajectory, observation: str, info: dict) -> None:
        setup = self.setups[t.spec.tag]
        first = self._user_turn(t, observation, info)
        instruction = info.get("env_instruction")
        if instruction:
            first = f"{instruction}\n{first}" if first else str(instruction)
        system = self._system(setup)
        t.messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": first}]
        t.prompt_ids = self.stitcher.initial_ids(t.messages)
        if len(t.prompt_ids) >= self.sequence_length:
            self._never_starts(t, setup)
            return
        t.opened = True

    def _never_starts(self, t: Trajectory, setup: EnvSetup) -> None:
        """An opening of `sequence_length` tokens or more leaves no room for a generated token: the
        episode is treated as one whose reset failed (ROLL would fail on its empty response mask), so
        that its reward 0 moves no baseline of its group. Its ids are dropped (an empty sample, not a
        row past the budget); its messages stay for the transcript."""
        opening = len(t.prompt_ids)
        t.stop_reason, t.prompt_ids = "max_length", []
        key = (t.spec.tag, "opening_too_long")
        if key not in self.errors_logged:  # once per tag: traj/opening_too_long counts the rest
            self.errors_logged.add(key)
            logger.warning("env %r (%s): the opening of episode %s is %d tokens, sequence_length is %d: no token "
                           "can be generated, so the episode never starts (in no baseline, trains nothing; "
                           "counted in traj/opening_too_long); raise sequence_length or shorten the env's "
                           "observation and templates", t.spec.tag, setup.config.env_type, t.spec.group_id, opening,
                           self.sequence_length)

    def _user_turn(self, t: Trajectory, observation: str, info: dict) -> str:
        config = self.setups[t.spec.tag].config
        return format_turn(config.agent_template, observation, t.turns + 1, config.max_steps - t.turns,
                           min(config.max_tokens_per_step, self.max_new_tokens), str(info.get("suffix", "") or ""))

    @staticmethod
    def _system(setup: EnvSetup) -> Optional[str]:
        return setup.config.agent_system_template or None

    def _after_turn(self, t: Trajectory, out: TurnOutput) -> None:
        t.add_turn(list(out.ids), list(out.log_probs), out.weight_version)

    def _fail(self, t: Trajectory, exc: BaseException, setup: EnvSetup) -> None:
        timed_out = isinstance(exc, EnvCallError) and exc.timed_out
        t.stop_reason = "env_timeout" if timed_out else "env_error"
        t.error = f"{type(exc).__name__}: {exc}"
        turn = t.turns + 1
        if t.prompt_ids or t.response_ids:
            t.step_rewards.append(setup.error_penalty)
        key = (t.spec.tag, t.stop_reason)
        if key not in self.errors_logged:  # once per tag and kind: the counters carry the rest
            self.errors_logged.add(key)
            logger.warning("env %r (%s) %s at turn %d of episode %s: %s; the episode ends with reward %g "
                           "(counted in env/%s)", t.spec.tag, setup.config.env_type,
                           "timed out" if timed_out else "failed", turn, t.spec.group_id, t.error,
                           setup.error_penalty, "timeouts" if timed_out else "errors")


def _check_reset(result: Any) -> Tuple[str, dict]:
    if not (isinstance(result, tuple) and len(result) == 2):
        raise EnvCallError(f"reset() must return (observation: str, info: dict), got {type(result).__name__}")
    observation, info = result
    if not isinstance(observation, str):
        raise EnvCallError(f"reset() returned a {type(observation).__name__} observation; observations must be str")
    return observation, info if isinstance(info, dict) else {}


def _check_step(result: Any):
    if not (isinstance(result, tuple) and len(result) == 5):
        raise EnvCallError("step() must return (observation, reward, terminated, truncated, info), got "
                           f"{type(result).__name__}{' of ' + str(len(result)) if isinstance(result, tuple) else ''}")
    observation, reward, terminated, truncated, info = result
    if not isinstance(observation, str):
        raise EnvCallError(f"step() returned a {type(observation).__name__} observation; observations must be str")
    try:
        reward = float(reward)
    except (TypeError, ValueError):
        raise EnvCallError(f"step() returned a non-numeric reward {reward!r}") from None
    if reward != reward or reward in (float("inf"), float("-inf")):
        raise EnvCallError(f"step() returned a non-finite reward {reward!r}")
    return observation, reward, bool(terminated), bool(truncated), info if isinstance(info, dict) else {}


class _Engine:
    """The rollout engine's calls, one at a time, in a thread of their own (the loop keeps stepping
    envs meanwhile)."""

    def __init__(self, generate: GenerateFn):
        self.generate = generate
        self.thread: Optional[threading.Thread] = None

    def submit(self, requests: List[TurnRequest]) -> Future:
        future: Future = Future()

        def run():
            try:
                outputs = self.generate(requests)
                if len(outputs) != len(requests):
                    raise RuntimeError(f"the rollout engine returned {len(outputs)} turns for {len(requests)} requests")
                future.set_result(outputs)
            except BaseException as exc:  # noqa: BLE001 - re-raised in the loop's thread
                future.set_exception(exc)

        self.thread = threading.Thread(target=run, daemon=True, name="roll-gspo-generate")
        self.thread.start()
        return future

    def close(self) -> None:
        if self.thread is not None:
            self.thread.join(timeout=0)
