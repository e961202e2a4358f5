"""Token capture: what the endpoint records of each episode, and its trajectories.

An episode is a list of segments; a segment is one token-in/token-out conversation, a
`roll_gspo.agentic.trajectory.Trajectory` built exactly as the built-in agentic path builds one:
its opening (the first request's prompt ids, rendered and tokenised once), then per request the
engine's sampled ids (`append_generated`: mask 1, their log-probs and weight versions) and, before
the next request's turn, only what the client appended, rendered as the chat template's suffix and
tokenised once (`append_context`: mask 0; `ChatStitcher.suffix_ids`, the agentic path's code).

A request continues a segment when the messages it sends begin with the segment's messages as the
endpoint recorded them (the assistant turns as it returned them, compared field by field after
normalisation: role, text content, tool calls by name and parsed arguments, tool_call_id): the
recorded ids are reused and never re-tokenised. Anything else (an edited or dropped message, a
replayed earlier turn, a changed tool list) opens a new segment from the rendered text and counts a
mismatch: ids are never spliced onto a history they do not belong to.

`/v1/completions` requests match on text: a prompt that begins with a segment's prompt text plus
the completion text returned continues it, the rest tokenised once.

The store is bounded (`max_episodes`): opening a record past the bound evicts the least recently
used record no request holds, counted. A record taken (`take`) or evicted is closed: an answer
landing after that (its agent timed out meanwhile) is counted and logged, never written into the
trajectories already handed to training.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import threading
import time
import uuid
from collections import OrderedDict
from typing import Any, Dict, List, Optional, Sequence

from roll_gspo.agentic.tokens import ChatStitcher
from roll_gspo.agentic.trajectory import EpisodeSpec, Trajectory

logger = logging.getLogger("roll_gspo.serving")
Message = Dict[str, Any]


def message_text(content: Any) -> str:
    """A message's text: a string, or the text parts of a content list."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content if isinstance(part, dict)
                       and part.get("type", "text") == "text")
    return str(content)


def tool_arguments(raw: Any) -> Any:
    """A tool call's arguments as parsed JSON (the text itself when it is not JSON)."""
    if isinstance(raw, str):
        try:
            return json.loads(raw)
        except ValueError:
            return raw
    return raw


def message_key(message: Message) -> str:
    """What a message is for matching: role, text, tool calls (name, parsed arguments), tool call id."""
    calls = [(c.get("function", {}).get("name"), tool_arguments(c.get("function", {}).get("arguments")))
             for c in message.get("tool_calls") or []]
    return json.dumps([message.get("role"), message_text(message.get("content")), calls,
                       message.get("tool_call_id"), message.get("name") if message.get("role") == "tool" else None],
                      sort_keys=True, default=str)


@dataclasses.dataclass
class Segment:
    """One conversation of an episode as token ids (`trajectory`), with what matches it."""
    trajectory: Trajectory
    keys: List[str] = dataclasses.field(default_factory=list)  # chat: messages so far, the last the assistant's
    tools_key: str = ""
    text: Optional[str] = None  # completions: prompt text + completion text so far
    last_finished: bool = True  # the last turn ended with the end-of-turn id (the suffix then drops its text)


@dataclasses.dataclass
class EpisodeRecord:
    """Everything one episode sent through the endpoint."""
    episode_id: str
    segments: List[Segment] = dataclasses.field(default_factory=list)
    requests: int = 0
    reused_turns: int = 0  # requests whose history was the recorded ids
    mismatches: int = 0  # requests that opened a new segment after the first
    failures: int = 0  # requests that failed (client gone, engine error)
    errors: List[str] = dataclasses.field(default_factory=list)
    rank: Optional[int] = None  # the rollout rank it is pinned to (its prefix in cache); freed with the record
    created: float = dataclasses.field(default_factory=time.time)
    reward: Optional[float] = None
    kept: bool = True  # False: a scratch record of a request nothing trains on (planned, never recorded)
    closed: bool = False  # taken or evicted: later answers are counted, not recorded
    users: int = 0  # requests holding it (EpisodeStore.open): never evicted meanwhile
    # The episode's requests run one at a time (their ids cannot interleave); freed with the record.
    lock: asyncio.Lock = dataclasses.field(default_factory=asyncio.Lock, repr=False, compare=False)

    @classmethod
    def scratch(cls, episode_id: str = "") -> "EpisodeRecord":
        """A record for one request that nothing will train on (no episode id, or a run that trains
        on no endpoint episode): the request is planned on it, its answer is not recorded."""
        return cls(episode_id, kept=False)

    def trajectories(self, reward: Optional[float] = None, group_id: Optional[str] = None,
                     index: int = 0) -> List[Trajectory]:
        """One trajectory per segment with a generated token, each rewarded `reward` (or the
        record's) on its last turn; masks, log-probs and turns as the built-in agentic path's."""
        reward = self.reward if reward is None else reward
        out = []
        for segment in self.segments:
            t = segment.trajectory
            if not any(t.agent_mask):
                continue
            t.spec = EpisodeSpec("endpoint", 0, group_id or self.episode_id, index)
            if reward is not None and t.step_rewards:
                t.step_rewards = [0.0] * (len(t.step_rewards) - 1) + [float(reward)]
            t.stop_reason = t.stop_reason or "terminated"
            out.append(t)
        return out


class TurnPlan:
    """What one request sends to the engine (`prompt_ids`) and how to record its answer."""

    def __init__(self, record: EpisodeRecord, segment: Segment, prompt_ids: List[int], context: List[int],
                 new_segment: bool, keys: List[str], text: Optional[str]):
        self.record, self.segment, self.prompt_ids = record, segment, prompt_ids
        self.context, self.new_segment, self.keys, self.text = context, new_segment, keys, text


class EpisodeStore:
    """The run's episodes by id, least recently used first (in memory, this process only: nothing
    serves them over HTTP, so another run or client cannot read them). At most `max_episodes`
    records no request holds: a client sending new ids cannot grow it without bound. Thread-safe."""

    def __init__(self, stitcher: ChatStitcher, render, max_episodes: int = 1024):
        """`render(messages, tools) -> text`: the run's chat template (with the tools, when given)."""
        if max_episodes < 1:
            raise ValueError(f"max_episodes must be at least 1, got {max_episodes}")
        self.stitcher = stitcher
        self.render = render
        self.max_episodes = max_episodes
        self.episodes: "OrderedDict[str, EpisodeRecord]" = OrderedDict()
        self.evicted = 0  # records dropped at the bound before anything took them
        self.late_turns = 0  # answers that landed after their record was taken or evicted
        self.lock = threading.Lock()

    @staticmethod
    def new_id() -> str:
        return f"ep-{uuid.uuid4().hex}"

    def open(self, episode_id: str) -> EpisodeRecord:
        """The episode's record for a request (created if new), held until `release`. A new record
        past `max_episodes` evicts the least recently used ones no request holds."""
        with self.lock:
            record = self.episodes.get(episode_id)
            if record is None:
                record = self.episodes[episode_id] = EpisodeRecord(episode_id)
            record.users += 1
            self.episodes.move_to_end(episode_id)
            self._evict()
            return record

    def release(self, record: EpisodeRecord) -> None:
        """The request that opened `record` is done with it: it may be evicted again."""
        with self.lock:
            record.users -= 1

    def _evict(self) -> None:
        """Drop idle records, oldest use first, down to the bound (held ones stay: their requests
        would otherwise record into a record nothing can take). Called with the lock held."""
        excess = len(self.episodes) - self.max_episodes
        if excess <= 0:
            return
        idle = [eid for eid, r in self.episodes.items() if r.users == 0][:excess]
        for eid in idle:
            self.episodes.pop(eid).closed = True
        self.evicted += len(idle)
        if idle:
            logger.warning("rollout endpoint: %d episode record(s) evicted at the bound of %d (%d in all); "
                           "nothing had taken them", len(idle), self.max_episodes, self.evicted)

    def take(self, episode_id: str) -> Optional[EpisodeRecord]:
        """Remove and return an episode's record (the trainer side, once the episode is over),
        closed: a request of it still at the engine no longer writes into what was handed out."""
        with self.lock:
            record = self.episodes.pop(episode_id, None)
            if record is not None:
                record.closed = True
            return record

    # -- planning a request ---------------------------------------------------------------------------
    def plan_chat(self, record: EpisodeRecord, messages: Sequence[Message], tools: Optional[list]) -> TurnPlan:
        keys = [message_key(m) for m in messages]
        tools_key = json.dumps(tools or [], sort_keys=True, default=str)
        with self.lock:
            for segment in reversed(record.segments):
                n = len(segment.keys)
                if (segment.keys and segment.tools_key == tools_key and len(keys) > n and keys[:n] == segment.keys):
                    new = [_for_template(m) for m in messages[n:]]
                    suffix = self.stitcher.suffix_ids(new, segment.last_finished)
                    return TurnPlan(record, segment, segment.trajectory.context_ids() + suffix, suffix, False, keys,
                                    None)
        prompt = self.stitcher.encode(self.render(list(messages), tools))
        segment = Segment(Trajectory(EpisodeSpec("endpoint", 0, record.episode_id, 0)), tools_key=tools_key)
        return TurnPlan(record, segment, prompt, prompt, True, keys, None)

    def plan_completion(self, record: EpisodeRecord, prompt: str) -> TurnPlan:
        with self.lock:
            for segment in reversed(record.segments):
                if segment.text is not None and len(prompt) >= len(segment.text) and prompt.startswith(segment.text):
                    rest = self.stitcher.encode(prompt[len(segment.text):])
                    return TurnPlan(record, segment, segment.trajectory.context_ids() + rest, rest, False, [], prompt)
        ids = self.stitcher.encode(prompt)
        segment = Segment(Trajectory(EpisodeSpec("endpoint", 0, record.episode_id, 0)), text="")
        return TurnPlan(record, segment, ids, ids, True, [], prompt)

    # -- recording its answer -------------------------------------------------------------------------
    def record(self, plan: TurnPlan, token_ids: List[int], log_probs: List[float], weight_versions: List[int],
               returned: Optional[Message] = None, completion_text: str = "") -> None:
        """The engine's answer to `plan`: ids kept verbatim. `returned`: the assistant message as
        sent to the client (chat); `completion_text`: the text sent (completions). Nothing for a
        scratch record; a closed one (taken or evicted while the request ran) counts a late turn."""
        record, segment = plan.record, plan.segment
        t = segment.trajectory
        with self.lock:
            if not record.kept:
                return
            if record.closed:
                self._late(record)
                return
            record.requests += 1
            if plan.new_segment:
                if record.segments:
                    record.mismatches += 1
                record.segments.append(segment)
                t.prompt_ids = list(plan.context)
                t.opened = True
            else:
                record.reused_turns += 1
                t.append_context(list(plan.context))
            t.append_generated(list(token_ids), list(log_probs))
            t.step_rewards.append(0.0)
            versions = getattr(t, "token_weight_versions", [])
            versions += list(weight_versions)
            t.token_weight_versions = versions  # type: ignore[attr-defined]
            t.weight_version = min(versions) if versions else t.weight_version
            segment.last_finished = self.stitcher.turn_finished(token_ids)
            if returned is not None:
                segment.keys = plan.keys + [message_key(returned)]
                t.messages = t.messages + [dict(m) for m in [returned]]
            if plan.text is not None:
                segment.text = plan.text + completion_text

    def _late(self, record: EpisodeRecord) -> None:
        """An answer for a record already taken or evicted: counted and logged, not recorded (the
        record's trajectories may be in training). Called with the lock held."""
        self.late_turns += 1
        logger.warning("rollout endpoint: an answer of episode %s landed after its record was taken or evicted "
                       "(its agent timed out?); not recorded (%d late turns in all)", record.episode_id,
                       self.late_turns)

    def fail(self, record: EpisodeRecord, reason: str) -> None:
        """A failed request of the episode, on its record (not on one already handed out)."""
        with self.lock:
            if record.kept and not record.closed:
                record.failures += 1
                record.errors.append(reason)

    def counters(self) -> Dict[str, float]:
        with self.lock:
            records = list(self.episodes.values())
            evicted, late = self.evicted, self.late_turns
        return {"episodes": float(len(records)), "evicted": float(evicted), "late_turns": float(late),
                "requests": float(sum(r.requests for r in records)),
                "reused_turns": float(sum(r.reused_turns for r in records)),
                "mismatches": float(sum(r.mismatches for r in records)),
                "failures": float(sum(r.failures for r in records))}


def _for_template(message: Message) -> Dict[str, str]:
    """A message as the named chat templates render it (role and text; tool calls written out in
    hermes form, as a model trained on them writes them)."""
    parts = [message_text(message.get("content"))]
    parts += ["<tool_call>\n" + json.dumps({"name": c.get("function", {}).get("name"),
                                            "arguments": tool_arguments(c.get("function", {}).get("arguments"))},
                                           ensure_ascii=False) + "\n</tool_call>"
              for c in message.get("tool_calls") or []]
    return {"role": str(message.get("role", "user")), "content": "\n".join(p for p in parts if p)}


def template_messages(messages: Sequence[Message]) -> List[Dict[str, str]]:
    return [_for_template(m) for m in messages]


def tools_system_block(tools: Sequence[Dict[str, Any]]) -> str:
    """Qwen2.5's tool instructions (hermes calls), for the named ChatML templates."""
    lines = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with "
            "function signatures within <tools></tools> XML tags:\n<tools>\n" + lines + "\n</tools>\n\nFor each "
            "function call, return a json object with function name and arguments within <tool_call></tool_call> "
            "XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call>")


def with_tools(messages: List[Dict[str, str]], tools: Optional[Sequence[Dict[str, Any]]]) -> List[Dict[str, str]]:
    """`messages` with the tool block in the system message (one added when there is none)."""
    if not tools:
        return messages
    block = tools_system_block(tools)
    if messages and messages[0]["role"] == "system":
        return [{"role": "system", "content": messages[0]["content"] + "\n\n" + block}] + messages[1:]
    return [{"role": "system", "content": block}] + messages
