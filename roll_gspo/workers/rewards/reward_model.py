"""Reward-model reward (ROLL's `reward_model` cluster / `reward_pretrain`)."""
from __future__ import annotations

from typing import Any, List, Sequence

from roll_gspo.distributed.batch import Batch
from roll_gspo.rewards import RewardProcess, load_reward_fn
from roll_gspo.rewards.reward_model import SequenceRewardModel
from roll_gspo.rewards.scoring import Outcome
from roll_gspo.workers.rewards.base import RewardWorker


class RewardModelWorker(RewardWorker):
    """Scores `prompt + response` with the sequence-classification model `model_args`
    (`reward_pretrain` when null), `infer_batch_size` texts per forward pass. With `reward_fn`
    set, the score is `model_weight * model score + rule_weight * rule score` (`reward_kwargs`,
    both 1.0 by default); a rule that fails or times out makes the response's status `error` /
    `timeout` and its score 0. Accuracy (`val/accuracy`) is not defined for model scores."""

    correct_threshold = None

    def build_reward_fn(self):
        from roll_gspo.builtin.models import resolve_model

        cfg = self.cfg
        if not cfg.model_args.model_name_or_path:
            raise ValueError(f"rewards.{self.domain}.model_args.model_name_or_path (or reward_pretrain): the reward "
                             f"model to load")
        kwargs = self.reward_kwargs()
        self.model_weight = float(kwargs.pop("model_weight", 1.0))
        self.rule_weight = float(kwargs.pop("rule_weight", 1.0))
        self.rule_kwargs = kwargs
        device = "cuda" if cfg.num_gpus_per_worker > 0 else "cpu"
        self.model = SequenceRewardModel(resolve_model(cfg.model_args.model_name_or_path), dtype=cfg.model_args.dtype,
                                         batch_size=cfg.infer_batch_size, device=device)
        self.rule = load_reward_fn(cfg.reward_fn) if cfg.reward_fn else None
        if self.rule is not None:
            self.rule_process = RewardProcess(self.rule, cfg.timeout_s, self.rule_kwargs)
        return None

    def score_responses(self, prompts: Sequence[str], responses: Sequence[str], truths: Sequence[Any],
                        batch: Batch) -> List[Outcome]:
        scores = self.model.score(prompts, responses)
        if self.rule is None:
            return [(self.model_weight * s, "ok", "") for s in scores]
        rules = self.rule_process.score_many(list(zip(prompts, responses, truths)))
        return [(self.model_weight * s + self.rule_weight * r, "ok", "") if status == "ok" else (0.0, status, msg)
                for s, (r, status, msg) in zip(scores, rules)]

    def close(self) -> None:
        if getattr(self, "rule", None) is not None:
            self.rule_process.close()
        super().close()
