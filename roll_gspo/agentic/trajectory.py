"""One episode as the trainer sees it: the exact token ids, which of them the policy generated,
the engine's log-probs of those, and the environment's per-turn rewards."""
from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional

import torch

from roll_gspo.models.causal_lm import build_sequences, pad_2d

# Why an episode ended (`traj/stop/<reason>` counts them).
STOP_REASONS = ("terminated", "truncated", "max_turns", "max_length", "env_error", "env_timeout")


@dataclasses.dataclass
class EpisodeSpec:
    """What to play: the env tag, the seed shared by its group, and where the episode sits."""
    tag: str
    env_seed: int
    group_id: str  # ROLL's traj_group_id: tag, group and seed; equal within a group
    index: int  # position in the batch (consecutive within a group)


@dataclasses.dataclass
class Trajectory:
    spec: EpisodeSpec
    prompt_ids: List[int] = dataclasses.field(default_factory=list)  # opening, tokenised once
    response_ids: List[int] = dataclasses.field(default_factory=list)  # every later id, generated or not
    agent_mask: List[int] = dataclasses.field(default_factory=list)  # 1 on generated ids
    log_probs: List[float] = dataclasses.field(default_factory=list)  # engine log-probs, 0 on env ids
    turn_of_token: List[int] = dataclasses.field(default_factory=list)  # turn index of each response id
    step_rewards: List[float] = dataclasses.field(default_factory=list)  # one per turn
    messages: List[Dict[str, str]] = dataclasses.field(default_factory=list)  # text log (not trained on)
    stop_reason: Optional[str] = None
    success: bool = False
    tool_calls: int = 0
    tool_errors: int = 0
    invalid_actions: int = 0
    env_metrics: Dict[str, float] = dataclasses.field(default_factory=dict)
    weight_version: int = 0  # the oldest generated turn's version (`turn_versions`)
    turn_versions: List[int] = dataclasses.field(default_factory=list)  # per generated turn: the weights' version
    error: Optional[str] = None  # the env's exception or timeout, when it ended the episode
    opened: bool = False  # the episode started: its env's reset gave an opening that fits sequence_length

    @property
    def opening_too_long(self) -> bool:
        """Its env answered the reset, but the opening left no room for a token (never started)."""
        return not self.opened and self.stop_reason == "max_length"

    @property
    def turns(self) -> int:
        return len(self.step_rewards)

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)

    @property
    def reward(self) -> float:
        return float(sum(self.step_rewards))

    @property
    def done(self) -> bool:
        return self.stop_reason is not None

    def append_generated(self, ids: List[int], log_probs: List[float]) -> None:
        turn = len(self.step_rewards)
        self.response_ids += ids
        self.agent_mask += [1] * len(ids)
        self.log_probs += list(log_probs)
        self.turn_of_token += [turn] * len(ids)

    def add_turn(self, ids: List[int], log_probs: List[float], version: int) -> None:
        """A generated turn, every token of it sampled by the weights of `version`."""
        self.append_generated(ids, log_probs)
        self.turn_versions.append(int(version))
        self.weight_version = min(self.turn_versions)

    def token_versions(self) -> List[int]:
        """(T,) per response id: the version of the turn it belongs to (observations after a turn
        carry that turn's; they are in no loss)."""
        if not self.turn_versions:
            return [self.weight_version] * len(self.response_ids)
        last = len(self.turn_versions) - 1
        return [self.turn_versions[min(turn, last)] for turn in self.turn_of_token]

    def append_context(self, ids: List[int]) -> None:
        """Observation / tool ids (and a closing of a cut turn): in the context, not in the loss.
        They belong to the turn that produced them."""
        turn = max(len(self.step_rewards) - 1, 0)
        self.response_ids += ids
        self.agent_mask += [0] * len(ids)
        self.log_probs += [0.0] * len(ids)
        self.turn_of_token += [turn] * len(ids)

    def context_ids(self) -> List[int]:
        return self.prompt_ids + self.response_ids


def trajectory_tensors(trajectories: List[Trajectory], pad_token_id: int) -> Dict[str, torch.Tensor]:
    """Trainer tensors of trajectory-wise samples (one per episode).

    Returns input_ids (N, L), attention_mask (N, L), prompt_lengths (N,), response_mask (N, T)
    (1 on every response position: the contiguous span the trainer scores), loss_mask (N, T) (1 on
    generated ids only: observations and tool results stay out of the loss, KL and entropy),
    rollout_log_probs (N, T), turn_index (N, T) (long; -1 on padding).
    """
    input_ids, attention_mask, prompt_lengths, response_mask = build_sequences(
        [t.prompt_ids for t in trajectories], [t.response_ids for t in trajectories], pad_token_id)
    width = response_mask.shape[1]
    loss_mask = pad_2d([t.agent_mask for t in trajectories], 0, width).float()
    log_probs = torch.zeros(len(trajectories), width)
    for i, t in enumerate(trajectories):
        log_probs[i, :len(t.log_probs)] = torch.tensor(t.log_probs, dtype=torch.float32)
    turn_index = pad_2d([t.turn_of_token for t in trajectories], -1, width)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "prompt_lengths": prompt_lengths,
            "response_mask": response_mask, "loss_mask": loss_mask, "rollout_log_probs": log_probs,
            "turn_index": turn_index}


@dataclasses.dataclass
class TurnSample:
    """`env_manager_cls: step`: one turn of an episode as its own sample (context: the episode's ids
    before the turn, never re-tokenised; response: the turn's generated ids and what followed)."""
    trajectory: Trajectory
    turn: int
    start: int  # index in trajectory.response_ids where the turn's generated ids begin
    end: int


def turn_samples(trajectories: List[Trajectory]) -> List[TurnSample]:
    samples = []
    for t in trajectories:
        for turn in range(t.turns):
            positions = [i for i, (k, m) in enumerate(zip(t.turn_of_token, t.agent_mask)) if k == turn and m]
            if positions:
                samples.append(TurnSample(t, turn, positions[0], positions[-1] + 1))
    return samples


def turn_sample_tensors(samples: List[TurnSample], pad_token_id: int) -> Dict[str, torch.Tensor]:
    """As `trajectory_tensors`, one row per turn: prompt = the episode's ids before the turn."""
    input_ids, attention_mask, prompt_lengths, response_mask = build_sequences(
        [s.trajectory.prompt_ids + s.trajectory.response_ids[:s.start] for s in samples],
        [s.trajectory.response_ids[s.start:s.end] for s in samples], pad_token_id)
    width = response_mask.shape[1]
    log_probs = torch.zeros(len(samples), width)
    for i, s in enumerate(samples):
        log_probs[i, :s.end - s.start] = torch.tensor(s.trajectory.log_probs[s.start:s.end], dtype=torch.float32)
    turn_index = torch.where(response_mask.bool(), torch.tensor([s.turn for s in samples])[:, None],
                             torch.full_like(response_mask, -1, dtype=torch.long))
    return {"input_ids": input_ids, "attention_mask": attention_mask, "prompt_lengths": prompt_lengths,
            "response_mask": response_mask, "loss_mask": response_mask.clone(), "rollout_log_probs": log_probs,
            "turn_index": turn_index}


def transcript(trajectory: Trajectory) -> Dict[str, Any]:
    """A JSON-able record of an episode (render_save_dir)."""
    spec = trajectory.spec
    return {"tag": spec.tag, "env_seed": spec.env_seed, "group_id": spec.group_id, "reward": trajectory.reward,
            "success": trajectory.success, "turns": trajectory.turns, "stop_reason": trajectory.stop_reason,
            "error": trajectory.error, "messages": trajectory.messages}
