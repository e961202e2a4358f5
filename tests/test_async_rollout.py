"""One-step off-policy rollout (async_generation_ratio: 1, issue 14 item 4) on the real stack, with
token-budget micro-batches in training and scoring (item 3) on two ZeRO-2 ranks: each step's
responses were sampled by the weights of the step before the one that trains on them (the
rollout workers stamp the weight version each sync delivers), and resuming from a checkpoint
taken while the next rollout was already generated gives exactly the uninterrupted run."""
import os

import pytest
import torch

from tests.test_pipeline_e2e import load_weights, run, write_config
from tests.test_resume_chaos import comparable

pytestmark = pytest.mark.e2e
ASYNC = dict(async_generation_ratio=1, old_logprob_source="rollout", max_steps=3, save_steps=1,
             save_total_limit=3)
DYNAMIC = {"use_dynamic_batching_in_train": True, "max_tokens_per_microbatch_in_train": 48,
           "sequence_length_round_in_train": 4, "use_dynamic_batching_in_infer": True,
           "max_tokens_per_microbatch_in_infer": 96}


def test_next_rollout_comes_from_the_previous_weights_and_resume_is_exact(tmp_path, tiny_model, ray_session):
    cfg = write_config(tmp_path, tiny_model, actor_train=DYNAMIC, **ASYNC)
    records = run(cfg)
    assert [r["step"] for r in records] == [1, 2, 3]
    # Step 1 trains on responses of the initial weights (version 0); step N > 1 on those sampled by
    # the weights of step N - 2 while step N - 1 trained: one step stale.
    assert [r["rollout/weight_version"] for r in records] == [0.0, 0.0, 1.0]
    assert [r["rollout/staleness"] for r in records] == [0.0, 1.0, 1.0]
    for record in records:
        assert 0.0 <= record["actor/padding_frac"] < 0.5 and record["sync/seconds"] > 0
    checkpoints = os.path.join(cfg.output_dir, "checkpoints")
    assert os.path.exists(os.path.join(checkpoints, "step_2", "rollout_buffer.pt"))  # generated ahead, saved
    assert not os.path.exists(os.path.join(checkpoints, "step_3", "rollout_buffer.pt"))  # nothing after the last
    weights = load_weights(os.path.join(cfg.output_dir, "final_model"))

    resumed = write_config(tmp_path, tiny_model, actor_train=DYNAMIC, **{
        **ASYNC, "resume_from_checkpoint": os.path.join(checkpoints, "step_2")})
    rerun = run(resumed)
    assert comparable(rerun[-1]) == comparable(records[-1])  # step 3 again, from the saved rollout
    final = load_weights(os.path.join(resumed.output_dir, "final_model"))
    for key, value in final.items():
        assert torch.equal(value, weights[key]), key
