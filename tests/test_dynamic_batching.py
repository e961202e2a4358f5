"""Token-budget micro-batches (ROLL's use_dynamic_batching_in_train / _in_infer):
the split packs sorted rows under the budget and cuts padding, and the trainer's gradients and
logged losses are those of the fixed split, for every loss_agg_mode. The trainer's own
micro-batch loop runs on a real model; a one-process strategy stands in for DeepSpeed's rank
(its multi-rank behaviour runs in tests/test_async_rollout.py)."""
import pytest
import torch

from roll_gspo.schema.config import PipelineConfig
from roll_gspo.distributed.batch import Batch
from roll_gspo.distributed.micro_batching import (fixed_micro_batches, sequence_lengths, take,
                                                  token_budget_micro_batches)
from roll_gspo.models.causal_lm import build_sequences, load_causal_lm, score_micro_batches

MODES = ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


def sequences(rows, seed=0, vocab=40, prompt=(3, 9), response=(1, 12)):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(2, vocab, (int(n),), generator=g).tolist() for n in torch.randint(*prompt, (rows,), generator=g)]
    responses = [torch.randint(2, vocab, (int(n),), generator=g).tolist()
                 for n in torch.randint(*response, (rows,), generator=g)]
    input_ids, attention, prompt_lengths, response_mask = build_sequences(prompts, responses, 0)
    batch = Batch({"input_ids": input_ids, "attention_mask": attention, "prompt_lengths": prompt_lengths,
                   "response_mask": response_mask})
    width = response_mask.shape[1]
    batch["old_log_probs"] = -torch.rand(rows, width, generator=g) * 3
    batch["ref_log_probs"] = batch["old_log_probs"] + 0.3 * torch.randn(rows, width, generator=g)
    batch["advantages"] = torch.randn(rows, 1, generator=g).expand(rows, width).clone()
    return batch


def padding_stats(plans, batch):
    """(real tokens, tokens computed including padding) of a split of `batch`."""
    return sum(sequence_lengths(batch)), sum(m.padded_tokens() for m in plans)


def test_budget_packs_sorted_rows_and_cuts_padding():
    batch = sequences(16, seed=1)
    lengths = batch["attention_mask"].sum(-1).tolist()
    plans = token_budget_micro_batches(batch, max_tokens=40, round_to=4)
    assert sorted(r for p in plans for r in p.rows) == list(range(16))  # every row once
    order = [r for p in plans for r in p.rows]
    assert [lengths[r] for r in order] == sorted(lengths)  # shortest first
    for plan in plans:
        assert plan.padded_tokens() <= 40
        assert plan.width >= max(lengths[r] for r in plan.rows)
        assert plan.width % 4 == 0 or plan.width == batch["input_ids"].shape[1]
    real, dynamic = padding_stats(plans, batch)
    _, fixed = padding_stats(fixed_micro_batches(batch, 4), batch)
    assert real <= dynamic < fixed
    with pytest.raises(ValueError, match="max_tokens_per_microbatch_in_train = 8 is smaller than one sequence"):
        token_budget_micro_batches(batch, 8, 4, key="max_tokens_per_microbatch_in_train")


def test_take_cuts_both_layouts_to_the_micro_batch():
    batch = sequences(6, seed=2)
    plan = token_budget_micro_batches(batch, max_tokens=1000, round_to=1)[0]
    part = take(batch, fixed_micro_batches(batch, 2)[0])
    assert part["input_ids"].shape[1] == max(batch["attention_mask"][:2].sum(-1))
    assert part["old_log_probs"].shape[1] == part["response_mask"].shape[1] == max(batch["response_mask"][:2].sum(-1))
    assert take(batch, plan)["input_ids"].shape == batch["input_ids"].shape  # one row set, the whole width


def test_scoring_by_token_budget_equals_fixed_micro_batches(tiny_model):
    model = load_causal_lm(tiny_model).eval()
    batch = sequences(12, seed=3)
    mask = batch["response_mask"].bool()
    with torch.no_grad():
        fixed = score_micro_batches(model, batch, fixed_micro_batches(batch, 12), 0.7)
        dynamic = score_micro_batches(model, batch, token_budget_micro_batches(batch, 30, 4), 0.7)
    assert dynamic.shape == fixed.shape
    torch.testing.assert_close(dynamic[mask], fixed[mask], rtol=1e-5, atol=1e-5)


class OneRankStrategy:
    """One rank without DeepSpeed: backward, and at each optimizer-step boundary keep the
    accumulated gradient and clear it (no update: every mini-batch sees the same weights)."""

    class NothingOffloaded:
        offloaded = frozenset()

        def reload(self):
            pass

    global_steps = 0  # no update: every mini-batch sees the same weights

    def __init__(self, model):
        self.model, self.step_grads, self.passes = model, [], 0
        self.offloader = self.NothingOffloaded()

    def all_reduce_sum(self, values):
        return list(values)

    def max_over_ranks(self, values):
        return list(values)

    def backward_and_step(self, loss, boundary):
        loss.backward()
        self.passes += 1
        if boundary:
            self.step_grads.append({n: p.grad.clone() for n, p in self.model.named_parameters()})
            self.model.zero_grad(set_to_none=False)

    def grad_norm(self):
        return 0.0

    def learning_rate(self):
        return 0.0


def train_once(model_dir, batch, mode, dynamic):
    from roll_gspo.workers.actor_train import ActorTrainWorker

    cfg = PipelineConfig()
    cfg.loss_agg_mode, cfg.loss_norm_length, cfg.use_kl_loss, cfg.kl_loss_coef = mode, 12, True, 0.1
    cfg.ppo_epochs, cfg.pg_clip_low, cfg.pg_clip_high = 1, 0.02, 0.03
    role = cfg.actor_train
    role.training_args.per_device_train_batch_size, role.training_args.gradient_accumulation_steps = 3, 2
    role.use_dynamic_batching_in_train, role.max_tokens_per_microbatch_in_train = dynamic, 24
    model = load_causal_lm(model_dir)
    worker = ActorTrainWorker.__new__(ActorTrainWorker)  # the rank without its Ray/DeepSpeed set-up
    worker.cfg, worker.role, worker.rank, worker.temperature = cfg, role, 0, 0.7
    worker.moe, worker.offload = None, False
    worker.engine, worker.strategy = model, OneRankStrategy(model)
    metrics = worker.train_step(batch)
    return worker.strategy, metrics


@pytest.mark.parametrize("mode", MODES)
def test_same_gradients_with_and_without_dynamic_batching(tiny_model, mode):
    batch = sequences(12, seed=4)  # 2 mini-batches of 6 rows: 2 fixed micro-batches of 3 each
    fixed, fixed_metrics = train_once(tiny_model, batch, mode, dynamic=False)
    dynamic, dynamic_metrics = train_once(tiny_model, batch, mode, dynamic=True)
    assert fixed.passes == 4 and dynamic.passes != 4  # the budget really split differently
    assert len(fixed.step_grads) == len(dynamic.step_grads) == 2
    for want, got in zip(fixed.step_grads, dynamic.step_grads):
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-6, msg=name)
    for key in ("actor/pg_loss", "actor/kl_loss", "actor/clipfrac", "actor/ratio_mean", "actor/kl_mean"):
        assert dynamic_metrics[key] == pytest.approx(fixed_metrics[key], rel=1e-5, abs=1e-7), key
    assert dynamic_metrics["actor/padding_frac"] < fixed_metrics["actor/padding_frac"]
