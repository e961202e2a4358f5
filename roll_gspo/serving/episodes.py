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
"""
from __future__ import annotations

import dataclasses
import json
import threading
import time
import uuid
from typing import Any, Dict, List, Optional, Sequence

from roll_gspo.agentic.tokens import ChatStitcher
from roll_gspo.agentic.trajectory import EpisodeSpec, Trajectory

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


def _arguments(raw: Any) -> Any:
    if isinstance(raw, str):
        try:
            return json.loads(raw)
        except ValueError:
            return raw
    return raw


def message_key(message: Message) -> str:
    """What a message is for matching: role, text, tool calls (name, parsed arguments), tool call id."""
    calls = [(c.get("function", {}).get("name"), _arguments(c.get("function", {}).get("arguments")))
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
    rank: Optional[int] = None  # the rollout rank it is pinned to
    created: float = dataclasses.field(default_factory=time.time)
    reward: Optional[float] = None

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
    """The run's episodes by id (in memory, this process only: nothing serves them over HTTP, so
    another run or client cannot read them). Thread-safe."""

    def __init__(self, stitcher: ChatStitcher, render):
        """`render(messages, tools) -> text`: the run's chat template (with the tools, when given)."""
        self.stitcher = stitcher
        self.render = render
        self.episodes: Dict[str, EpisodeRecord] = {}
        self.lock = threading.Lock()

    @staticmethod
    def new_id() -> str:
        return f"ep-{uuid.uuid4().hex}"

    def get(self, episode_id: str) -> EpisodeRecord:
        with self.lock:
            record = self.episodes.get(episode_id)
            if record is None:
                record = self.episodes[episode_id] = EpisodeRecord(episode_id)
            return record

    def take(self, episode_id: str) -> Optional[EpisodeRecord]:
        """Remove and return an episode's record (the trainer side, once the episode is over)."""
        with self.lock:
            return self.episodes.pop(episode_id, None)

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
        sent to the client (chat); `completion_text`: the text sent (completions)."""
        record, segment = plan.record, plan.segment
        t = segment.trajectory
        with self.lock:
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

    def fail(self, record: EpisodeRecord, reason: str) -> None:
        with self.lock:
            record.failures += 1
            record.errors.append(reason)

    def counters(self) -> Dict[str, float]:
        with self.lock:
            records = list(self.episodes.values())
        return {"episodes": float(len(records)),
                "requests": float(sum(r.requests for r in records)),
                "reused_turns": float(sum(r.reused_turns for r in records)),
                "mismatches": float(sum(r.mismatches for r in records)),
                "failures": float(sum(r.failures for r in records))}


def _for_template(message: Message) -> Dict[str, str]:
    """A message as the named chat templates render it (role and text; tool calls written out in
    hermes form, as a model trained on them writes them)."""
    parts = [message_text(message.get("content"))]
    parts += ["<tool_call>\n" + json.dumps({"name": c.get("function", {}).get("name"),
                                            "arguments": _arguments(c.get("function", {}).get("arguments"))},
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
