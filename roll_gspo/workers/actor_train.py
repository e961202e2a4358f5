"""`actor_train` role: training-engine ranks (DeepSpeed ZeRO or torch FSDP2, `strategy_name`)
that score responses (old log-probs) and run the GSPO
update: ppo_epochs x mini-batches, one optimizer step per mini-batch, with the loss normalisers of
the whole mini-batch across ranks and micro-batches."""
from __future__ import annotations

import functools
import math
from contextlib import nullcontext
from typing import Any, Dict, List, Optional, Tuple

import torch

from roll_gspo.catalog.engines import ENGINES, engine_of
from roll_gspo.algorithms import (SEQUENCE_MEAN_METRICS, aggregate_loss, kept_mask, kl_loss, loss_normalisers,
                                  policy_loss, response_ratios, rollout_correction)
from roll_gspo.config.plan.policy_loss import policy_loss_options
from roll_gspo.config.plan.correction import correction_arguments, correction_enabled
from roll_gspo.config.plan.run_plan import RunPlan, build_run_plan
from roll_gspo.placement.colocation import memory_gb
from roll_gspo.schema.config import PipelineConfig, RoleConfig
from roll_gspo.distributed.batch import Batch
from roll_gspo.distributed.batch_fields import RESPONSE_RATIOS
from roll_gspo.distributed.cluster import HealthProbed, RankWorker
from roll_gspo.distributed.micro_batching import MicroBatch, ppo_mini_batches, role_micro_batches, scatter_rows, take
from roll_gspo.models.causal_lm import (num_micro_batches, padding_pass, padding_passes,
    response_token_log_probs, score_micro_batches)
from roll_gspo.lifecycle.seeding import trainer_seed
from roll_gspo.metrics.drift import TRAINER_GAPS
from roll_gspo.strategies import engine_class
from roll_gspo.sync.broadcast import RECEIVER_LOST, WeightSender, broadcast_weights, lost_fields, receiver_lost
from roll_gspo.workers.train_metrics import SplitInvariantMetrics


class NonFiniteLossError(RuntimeError):
    """A loss became NaN/inf; raised before the bad gradient reaches the weights."""


def forward_log_probs(engine, batch: Batch, temperature: float, with_entropy: bool = False,
                      entropy_grad: bool = False):
    """(B, T) log-probs of batch's responses under `engine` (T = batch response_mask width)."""
    return response_token_log_probs(engine, batch["input_ids"], batch["attention_mask"], batch["prompt_lengths"],
                                    batch["response_mask"].shape[1], temperature, with_entropy, entropy_grad)


def train_strategy_class(strategy_name: str):
    """The training engine a role's `strategy_name` names (roll_gspo.catalog.engines: `deepspeed_*`
    or `fsdp2_*`; the `_infer` names are the same engines, built frozen by the reference)."""
    if not engine_of(strategy_name).train_engine:
        raise ValueError(f"strategy_name {strategy_name!r} is no training engine; one of "
                         f"{', '.join(n for n, e in ENGINES.items() if e.train_engine)}")
    return engine_class(strategy_name)


def loss_mask(batch: Batch) -> torch.Tensor:
    """The tokens the loss sees: `loss_mask` when the driver masked responses out (ROLL's
    max_len_mask / difficulty_mask / error_max_len_clip), else the response mask."""
    return batch["loss_mask"] if "loss_mask" in batch else batch["response_mask"]


def kept_loss_mask(batch: Batch) -> torch.Tensor:
    """`loss_mask` less the tokens the rollout correction rejects (`rollout_is_keep`, when on):
    the mask of every term of the policy update and of its normalisers."""
    mask = loss_mask(batch)
    return kept_mask(mask, batch["rollout_is_keep"]) if "rollout_is_keep" in batch else mask


class ActorTrainWorker(HealthProbed, RankWorker):
    correction: Optional[Dict[str, Any]] = None  # train_infer_correction's keywords (set in __init__ when on)

    def __init__(self, cfg: PipelineConfig, *, dist_env: Dict[str, Any], total_optimizer_steps: int,
                 role_name: str = "actor_train", plan: Optional[RunPlan] = None):
        super().__init__(dist_env)
        self.cfg = cfg
        self.plan = plan if plan is not None else build_run_plan(cfg)  # the pipeline's; built here when used alone
        self.role: RoleConfig = getattr(cfg, role_name)
        self.total_optimizer_steps = total_optimizer_steps
        self.temperature = cfg.actor_infer.generating_args.temperature or 1.0
        self.weight_sender = None
        # train_infer_correction: keywords of algorithms.rollout_correction, None when off
        self.correction = correction_arguments(cfg) if cfg.has_rollout() and correction_enabled(cfg) else None

    @functools.cached_property
    def loss_options(self) -> Dict[str, Any]:
        """The policy loss's own keys (config/plan/policy_loss), read from the config once."""
        return policy_loss_options(self.cfg)

    def setup(self) -> None:
        self.offload = self.plan.offload_between_phases
        strategy_class = train_strategy_class(self.role.strategy_args.strategy_name)
        self.strategy = strategy_class(self.role, train=True, total_optimizer_steps=self.total_optimizer_steps,
                                       seed=self.cfg.seed, offload=self.offload)
        self.engine = self.strategy.engine
        self.moe = self._attach_moe_routing()
        if self.offload:  # room for the first generation
            self.strategy.offloader.offload(params=self.cfg.offload_train_params)

    def _attach_moe_routing(self):
        """Routing hooks for an MoE policy (record, replay, aux loss, metrics); None if dense."""
        from roll_gspo.models.moe_routing import TrainerRouting

        return TrainerRouting.attach(self.strategy.module, self.cfg.router_replay, self.cfg.moe_aux_loss_coef,
                                     self.role.infer_batch_size)

    def _routing(self, replay=None):
        return self.moe.capture(replay) if self.moe is not None else nullcontext()

    @torch.no_grad()
    def compute_log_probs(self, batch: Batch, adapter_disabled: bool = False) -> Batch:
        """Old log-probs of this rank's shard, in micro-batches of `infer_batch_size` rows (or by
        token budget: `use_dynamic_batching_in_infer`), as many forward passes as the busiest rank
        under ZeRO-3, where a forward pass is collective. `adapter_disabled` (a LoRA policy): the
        base model's log-probs instead, as the reference's (`ref_log_probs`)."""
        from roll_gspo.strategies.lora import adapter_disabled as adapter_off

        self.strategy.offloader.reload_weights()  # offload_train_params: the rest waits for training
        plans = role_micro_batches(batch, self.role, "infer")
        passes = self.strategy.scoring_passes(len(plans))
        self.engine.eval()
        if self.moe is None:
            try:
                with adapter_off(self.strategy.module, adapter_disabled):
                    log_probs = score_micro_batches(self.engine, batch, plans, self.temperature, passes)
            finally:
                self.engine.train()
            return Batch({"ref_log_probs" if adapter_disabled else "old_log_probs": log_probs})
        # MoE: micro-batch by micro-batch, recording the experts the old policy chose (replayed,
        # and compared after the update), then the same padding passes as the dense path.
        parts, routed = [], []
        try:
            for plan in plans:
                part = take(batch, plan)
                with self._routing():
                    log_probs, _ = forward_log_probs(self.engine, part, self.temperature)
                parts.append(log_probs)
                routed.append(self.moe.recorded(part["input_ids"]))
            padding_passes(self.engine, (passes or 0) - len(parts), self.temperature)
        finally:
            self.engine.train()
        if not parts:  # an empty shard: nothing scored, nothing recorded
            return Batch({"old_log_probs": torch.zeros(0, batch["response_mask"].shape[1]),
                          "routed_experts": torch.zeros(0, batch["input_ids"].shape[1], len(self.moe.hooks.routers),
                                                        self.moe.hooks.top_k, dtype=torch.int16)})
        width, length = batch["response_mask"].shape[1], batch["input_ids"].shape[1]
        return Batch({"old_log_probs": scatter_rows(parts, plans, len(batch), width),
                      "routed_experts": scatter_rows(routed, plans, len(batch), length)})

    def train_step(self, batch: Batch, sync_to: Optional[List[Any]] = None,
                   weight_version: Optional[int] = None) -> Dict[str, float]:
        """GSPO update on this rank's shard. Needs tensors input_ids, attention_mask,
        prompt_lengths, response_mask, old_log_probs, advantages (and ref_log_probs with
        use_kl_loss). Returns the call's metrics over all ranks (`SplitInvariantMetrics`: the
        loss is the mini-batch loss, averaged over mini-batches; token metrics are means over all
        tokens); with `sync_to` (the rollout workers), the new weights are then sent to them,
        stamped `weight_version`, and the `sync/*` metrics added."""
        cfg = self.cfg
        metrics = SplitInvariantMetrics()
        self._response_ratios: Dict[int, Tuple[float, float]] = {}  # row_index -> (ratio, clipped) when first trained
        self._response_gaps: Dict[int, torch.Tensor] = {}  # row_index -> per-token |trainer - rollout| before any update
        self.strategy.offloader.reload()
        # Mini-batch order and the torch RNG (dropout) are functions of the optimizer step, which
        # checkpoints restore, so a resumed run draws what an uninterrupted one does.
        generator = torch.Generator().manual_seed(cfg.seed + self.strategy.global_steps)
        torch.manual_seed(trainer_seed(cfg.seed, self.strategy.global_steps, self.rank))
        mini_batches = ppo_mini_batches(batch, self.role, cfg.ppo_epochs, generator)
        passes = self._passes_per_mini_batch([len(plans) for _, plans in mini_batches])
        for index, ((mini, plans), count) in enumerate(zip(mini_batches, passes)):
            self._train_mini_batch(mini, plans, count, metrics, before_any_update=index == 0)
        result = metrics.reduce(self.strategy.all_reduce_sum)
        if self._response_ratios:  # the driver sent row_index: it pops these for the rollout files
            result[RESPONSE_RATIOS] = self._response_ratios
        if self._response_gaps:  # the drift alarm's per-token gaps (roll_gspo.metrics.drift), popped by the driver
            result[TRAINER_GAPS] = self._response_gaps
        if self.moe is not None and "routed_experts" in batch:
            result.update(self._moe_step_metrics(batch))
        memory = self._offload_optimizer_side() if self.offload else {}
        if sync_to is not None:  # a lost receiver: RECEIVER_LOST in the result, the driver syncs again
            result.update(self.sync_weights_to(sync_to, weight_version))
        if self.offload:
            self.strategy.offloader.offload(params=cfg.offload_train_params)  # weights last: the sync read them
            memory["memory/actor_train_offload_gb"] = memory_gb()
        return {**result, **memory}

    def _offload_optimizer_side(self) -> Dict[str, float]:
        """After training, before the sync wakes the rollout engine: the optimizer side to CPU."""
        before = memory_gb()
        self.strategy.offloader.offload(params=False)
        return {"memory/actor_train_train_gb": before}

    @torch.no_grad()
    def _moe_step_metrics(self, batch: Batch) -> Dict[str, float]:
        """Routing metrics of this rank's shard; under ZeRO-3 padded to the busiest rank's passes."""
        micro = self.role.infer_batch_size
        passes = self.strategy.scoring_passes(num_micro_batches(len(batch), micro))
        self.engine.eval()
        try:
            metrics = (self.moe.step_metrics(batch, lambda part: forward_log_probs(self.engine, part, self.temperature))
                       if len(batch) else {})
            padding_passes(self.engine, (passes or 0) - num_micro_batches(len(batch), micro), self.temperature)
            return metrics
        finally:
            self.engine.train()

    def _passes_per_mini_batch(self, local: List[int]) -> List[int]:
        """Micro-batches per mini-batch, the most over ranks: ranks with fewer (token-budget
        micro-batches, a short last mini-batch) run padding passes, because every pass is
        collective under ZeRO-2/3 and FSDP2 (gradient reduction, parameter gathers). One all-reduce."""
        return self.strategy.max_over_ranks(local)

    def _train_mini_batch(self, mini: Batch, plans: List[MicroBatch], passes: int, metrics: SplitInvariantMetrics,
                          before_any_update: bool) -> None:
        """One optimizer step on the mini-batch, one forward/backward per micro-batch of `plans`,
        then padding passes up to `passes`."""
        cfg = self.cfg
        if self.correction is not None:  # on the whole mini-batch: its rejection enters the normalisers
            self._apply_rollout_correction(mini, metrics)
        # Normalisers of the whole mini-batch over all ranks, so the gradient does not depend on
        # the number of ranks or micro-batches; counted on the kept tokens, so a rollout-correction
        # rejection changes which tokens train, not the step size (verl, ROLL's recompute path).
        # The MoE aux loss is shared by the responses of the loss mask, rejected or not.
        num_seqs, num_tokens = loss_normalisers(kept_loss_mask(mini))
        num_seqs, num_tokens, aux_seqs = self.strategy.all_reduce_sum(
            [num_seqs, num_tokens, loss_normalisers(loss_mask(mini))[0]])
        real, computed = float(mini["attention_mask"].sum()), 0.0
        for index, plan in enumerate(plans):
            micro = take(mini, plan)  # `take` cuts rollout_is_weights / _keep with the response tensors
            computed += plan.padded_tokens()
            replay = micro["routed_experts"] if cfg.router_replay else None
            # Held through backward: gradient checkpointing re-runs each layer's forward there, routers
            # included, and a recomputed layer must route as the first pass did.
            with self._routing(replay):
                loss, micro_metrics, token_count, lag_gaps = self._micro_loss(micro, num_seqs, num_tokens,
                                                                              before_any_update, aux_seqs)
                self._check_finite(loss, micro_metrics)
                self.strategy.backward_and_step(loss, boundary=index == passes - 1)
            metrics.add_micro(micro_metrics, token_count)
            for key, (gap, count) in lag_gaps.items():  # each lag's mean over its tokens
                metrics.add_micro({key: gap}, count)
        for index in range(len(plans), passes):
            self.strategy.backward_and_step(padding_pass(self.engine, self.temperature).sum() * 0.0,
                                            boundary=index == passes - 1)
            computed += 2
        metrics.add_micro({"actor/padding_frac": 1.0 - real / max(computed, 1.0)}, computed)
        metrics.end_mini_batch()
        metrics.add_step({"actor/grad_norm": self.strategy.grad_norm(), "actor/lr": self.strategy.learning_rate()})

    def _apply_rollout_correction(self, mini: Batch, metrics: SplitInvariantMetrics) -> None:
        """Store the rollout correction's importance weights (`rollout_is_weights`) and kept tokens
        (`rollout_is_keep`) on the mini-batch, for its normalisers and `_micro_loss` (the correction
        is row by row, so the micro-batches' share is theirs); add its metrics (token means weighted
        by the mini-batch's tokens, response means by its responses, so they are split-invariant)."""
        mask = loss_mask(mini)
        correction, values = rollout_correction(mini["old_log_probs"], mini["rollout_log_probs"], mask,
                                                **self.correction)
        mini["rollout_is_weights"], mini["rollout_is_keep"] = correction.weights, correction.keep
        responses, tokens = loss_normalisers(mask)
        metrics.add_micro({k: v for k, v in values.items() if k not in SEQUENCE_MEAN_METRICS}, tokens)
        metrics.add_micro({k: v for k, v in values.items() if k in SEQUENCE_MEAN_METRICS}, responses)

    def _micro_loss(self, micro: Batch, num_seqs: float, num_tokens: float, before_any_update: bool,
                    aux_seqs: Optional[float] = None
                    ) -> "tuple[torch.Tensor, Dict[str, float], float, Dict[str, Tuple[float, float]]]":
        """The loss of one micro-batch (policy loss, KL, MoE aux, entropy bonus), normalised by the
        mini-batch's `num_seqs` / `num_tokens` over all ranks (of the kept tokens; the MoE aux loss
        by `aux_seqs`, default `num_seqs`); its metrics and their weight (kept tokens); with a
        staleness bound, the trainer-rollout log-prob gap per token lag, each with its weight (its
        tokens; empty otherwise)."""
        cfg = self.cfg
        full_mask = loss_mask(micro)
        micro_mask = kept_loss_mask(micro)  # tokens the rollout correction rejects leave every term of the loss
        log_probs, entropy = forward_log_probs(self.engine, micro, self.temperature, with_entropy=True,
                                               entropy_grad=cfg.entropy_loss_coef > 0)
        loss, pg_metrics = policy_loss(
            log_probs, micro["old_log_probs"], micro["advantages"], micro_mask,
            importance_sampling=cfg.importance_sampling, clip_low=cfg.pg_clip_low, clip_high=cfg.pg_clip_high,
            loss_agg_mode=cfg.loss_agg_mode, dual_clip_c=cfg.dual_clip_c if cfg.dual_clip_loss else None,
            num_seqs=num_seqs, num_tokens=num_tokens, norm_length=cfg.loss_norm_length,
            token_weights=micro["rollout_is_weights"] if "rollout_is_weights" in micro else None,
            surrogate=cfg.policy_loss, options=self.loss_options)
        if cfg.use_kl_loss:
            kl_value, kl_metrics = kl_loss(log_probs, micro["ref_log_probs"], micro_mask,
                                           estimator=cfg.kl_estimator, loss_agg_mode=cfg.loss_agg_mode,
                                           num_seqs=num_seqs, num_tokens=num_tokens,
                                           norm_length=cfg.loss_norm_length)
            loss = loss + cfg.kl_loss_coef * kl_value
            pg_metrics = {**pg_metrics, **kl_metrics}
        if self.moe is not None:
            aux_term, moe_metrics = self.moe.train_forward_extras(micro, num_seqs if aux_seqs is None else aux_seqs)
            loss = loss if aux_term is None else loss + aux_term
            pg_metrics = {**pg_metrics, **moe_metrics}
        if cfg.entropy_loss_coef > 0:  # entropy bonus, aggregated like the policy loss
            entropy_term = aggregate_loss(entropy, micro_mask, cfg.loss_agg_mode, num_seqs=num_seqs,
                                          num_tokens=num_tokens, norm_length=cfg.loss_norm_length)
            loss = loss - cfg.entropy_loss_coef * entropy_term
            pg_metrics = {**pg_metrics, "actor/entropy_loss": float(entropy_term.detach())}
            entropy = entropy.detach()
        if "row_index" in micro:
            self._note_response_ratios(micro["row_index"], log_probs.detach(), micro["old_log_probs"], full_mask)
        token_count = float(micro_mask.sum())
        micro_metrics = {**pg_metrics,
                         "actor/entropy": float((entropy * micro_mask).sum() / max(token_count, 1.0))}
        lag_gaps: Dict[str, Tuple[float, float]] = {}
        if before_any_update and "rollout_log_probs" in micro:
            # Trainer vs rollout engine on the same, not yet updated, policy.
            gap = (log_probs.detach() - micro["rollout_log_probs"]).abs()
            micro_metrics["rollout/logprob_gap"] = float((gap * full_mask).sum() / max(float(full_mask.sum()), 1.0))
            if "row_index" in micro:  # each response's gaps on its generated tokens (0 elsewhere), for the drift alarm
                for row, gaps in zip(micro["row_index"].tolist(), (gap * (full_mask > 0)).float()):
                    self._response_gaps[int(row)] = gaps.clone()  # its own storage: the row alone is sent
            if "token_lags" in micro:  # a staleness bound k >= 2: the gap per lag (trainer - token version)
                for lag in range(self.plan.staleness_bound + 1):  # every lag on every rank: same keys
                    own = full_mask * (micro["token_lags"] == lag)
                    count = float(own.sum())
                    lag_gaps[f"rollout/logprob_gap/lag{lag}"] = (float((gap * own).sum()) / max(count, 1.0), count)
        return loss, micro_metrics, token_count, lag_gaps

    def _note_response_ratios(self, rows: torch.Tensor, log_probs: torch.Tensor, old_log_probs: torch.Tensor,
                              mask: torch.Tensor) -> None:
        """Each response's ratio and clipped share the first time it is trained (ppo_epochs > 1 trains
        it again, later)."""
        cfg = self.cfg
        ratio, clipped = response_ratios(log_probs, old_log_probs, mask, importance_sampling=cfg.importance_sampling,
                                         clip_low=cfg.pg_clip_low, clip_high=cfg.pg_clip_high)
        for row, r, c in zip(rows.tolist(), ratio.tolist(), clipped.tolist()):
            self._response_ratios.setdefault(int(row), (r, c))

    def _check_finite(self, loss: torch.Tensor, details: Dict[str, float]) -> None:
        """Raise before a NaN/inf gradient exists. The other ranks then wait in their next
        collective; the driver sees this rank fail and stops them all (`Cluster` gathers fail-fast),
        which costs nothing per micro-batch, unlike agreeing on it with an all-reduce."""
        if not math.isfinite(float(loss.detach())):
            raise NonFiniteLossError(
                f"non-finite loss at optimizer step {self.strategy.global_steps} {details}; the weights "
                f"were not updated and saved checkpoints are intact. Check rewards and advantages for "
                f"NaN, or lower actor_train.training_args.learning_rate")

    def sft_step(self, batch: Batch) -> Dict[str, float]:
        """One pass of supervised fine-tuning over this rank's shard: token-mean cross-entropy on
        the response tokens (response_mask), normalised over the mini-batch across ranks."""
        args = self.role.training_args
        per_rank_mini = args.per_device_train_batch_size * args.gradient_accumulation_steps
        metrics = SplitInvariantMetrics()
        minis = [batch.select(range(start, min(start + per_rank_mini, len(batch))))
                 for start in range(0, len(batch), per_rank_mini)]
        plans = [role_micro_batches(mini, self.role, "train") for mini in minis]
        for mini, mini_plans, passes in zip(minis, plans, self._passes_per_mini_batch([len(p) for p in plans])):
            (num_tokens,) = self.strategy.all_reduce_sum([float(mini["response_mask"].sum())])
            for index, plan in enumerate(mini_plans):
                micro = take(mini, plan)
                log_probs, _ = forward_log_probs(self.engine, micro, 1.0)
                mask = micro["response_mask"]
                loss = -(log_probs * mask).sum() / max(num_tokens, 1.0)
                self._check_finite(loss, {})
                self.strategy.backward_and_step(loss, boundary=index == passes - 1)
                tokens = float(mask.sum())
                correct = (log_probs.detach().exp() > 0.5).float()
                metrics.add_micro({"sft/loss": float(-(log_probs.detach() * mask).sum()) / max(tokens, 1.0),
                                   "sft/token_acc": float((correct * mask).sum()) / max(tokens, 1.0)}, tokens)
            for index in range(len(mini_plans), passes):
                self.strategy.backward_and_step(padding_pass(self.engine).sum() * 0.0, boundary=index == passes - 1)
            metrics.end_mini_batch()
            metrics.add_step({"actor/grad_norm": self.strategy.grad_norm(), "actor/lr": self.strategy.learning_rate()})
        return metrics.reduce(self.strategy.all_reduce_sum)

    # -- weights and checkpoints ---------------------------------------------------------------
    def sync_weights_to(self, receivers: List[Any], version: Optional[int] = None) -> Dict[str, Any]:
        """The weights (or LoRA adapter) to every rollout rank of `receivers`, stamped `version`;
        the `sync/*` metrics. A receiver that died or stopped answering does not raise: the result
        then holds `RECEIVER_LOST` (why), every rank having gathered every bucket all the same, and
        the driver replaces the rank and syncs again (roll_gspo.distributed.replaceable)."""
        if self.cfg.lora_sync == "adapter" and self.role.model_args.uses_lora():
            from roll_gspo.strategies.lora import adapter_config
            from roll_gspo.sync.broadcast import broadcast_adapter

            weights_away = "lp_params" in self.strategy.offloader.offloaded  # e.g. the sync after a resume
            with self.strategy.offloader.on_device() if weights_away else nullcontext():
                try:
                    return broadcast_adapter(self.strategy, receivers if self.rank == 0 else None,
                                             adapter_config(self.strategy.module,
                                                            self.role.model_args.model_name_or_path),
                                             version, self.cfg.weight_sync_timeout_s,
                                             self.cfg.fault_tolerance.hang_timeout_s)
                except Exception as exc:  # noqa: BLE001 - sorted by receiver_lost
                    if not receiver_lost(exc):
                        raise
                    return {"sync/seconds": 0.0, **lost_fields(exc)}
        bucket_bytes = int(self.cfg.weight_sync_bucket_mb * (1 << 20))
        lost = None
        if self.rank == 0:
            try:
                self._sender_for(receivers, bucket_bytes)
            except Exception as exc:  # noqa: BLE001 - sorted by receiver_lost
                if not receiver_lost(exc):
                    raise
                lost = lost_fields(exc)
        sender = self.weight_sender if lost is None else None  # without one, rank 0 still gathers every bucket
        if "lp_params" not in self.strategy.offloader.offloaded:
            metrics = broadcast_weights(self.strategy, bucket_bytes, sender, version)
        else:
            with self.strategy.offloader.on_device():  # e.g. the sync after a resume
                metrics = broadcast_weights(self.strategy, bucket_bytes, sender, version)
        if lost is not None:
            metrics.update(lost)
        if RECEIVER_LOST in metrics:
            self.weight_sender = None  # made again for the ranks the driver then gives
        return metrics

    def _sender_for(self, receivers: List[Any], bucket_bytes: int) -> None:
        """Rank 0's `WeightSender` for these receivers: made once, and again when the rollout ranks
        changed (a rank replaced, or the driver syncing one new rank alone)."""
        sender = self.weight_sender
        if sender is not None and [r._actor_id for r in sender.receivers] == [r._actor_id for r in receivers]:
            return
        if sender is not None:
            sender.close()
        self.weight_sender = None
        self.weight_sender = WeightSender(receivers, self.cfg.weight_sync_transport, bucket_bytes,
                                          self.cfg.weight_sync_timeout_s, self.cfg.fault_tolerance.hang_timeout_s)

    def save_checkpoint(self, folder: str) -> None:
        self.strategy.save_checkpoint(folder)

    def load_checkpoint(self, folder: str, mode: str = "native") -> None:
        """`mode`: how (roll_gspo.lifecycle.reshape.ResumeAction.load_mode; the driver decided it)."""
        self.strategy.load_checkpoint(folder, mode)

    def save_hf_model(self, folder: str) -> None:
        self.strategy.save_hf_model(folder, self.role.model_args.model_name_or_path)

    def optimizer_steps(self) -> int:
        return self.strategy.global_steps
