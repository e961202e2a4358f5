"""Scale-out runtime: tensor-parallel vLLM rollout inside Ray, the collective weight transport
(equality and failure modes) and their config checks."""
import pytest
import torch

from roll_gspo.collective_sync import bucket_layout, pack_bucket, unpack_bucket
from roll_gspo.strategies.vllm_tp import cpu_thread_binding


def test_cpu_thread_binding_splits_cores_per_worker():
    assert cpu_thread_binding(2, [1, 0]) == "0|1"
    assert cpu_thread_binding(2, [0, 1, 2, 3, 4]) == "0,1|2,3"
    with pytest.raises(ValueError, match="tensor_parallel_size = 4 needs a CPU core per vLLM worker"):
        cpu_thread_binding(4, [0, 1])


def test_bucket_pack_roundtrip_mixed_dtypes():
    bucket = [("a", torch.randn(3, 5)), ("b", torch.arange(7, dtype=torch.int64)),
              ("c", torch.randn(4).to(torch.bfloat16)), ("empty", torch.zeros(0))]
    meta = bucket_layout(bucket)
    assert all(offset % 64 == 0 for _, offset, *_ in meta.layout)
    out = unpack_bucket(pack_bucket(bucket, meta, "cpu"), meta)
    for (name, sent), (got_name, got) in zip(bucket, out):
        assert name == got_name and got.dtype == sent.dtype and torch.equal(got, sent)


@pytest.mark.parametrize("overrides, expected", [
    (["+actor_infer.strategy_args.strategy_config.tensor_parallel_size=2"],
     "raise actor_infer.num_cpus_per_worker (1) to at least 2"),
    (["+actor_infer.strategy_args.strategy_config.tensor_parallel_size=2", "actor_infer.num_gpus_per_worker=1"],
     "needs a GPU per vLLM worker: raise actor_infer.num_gpus_per_worker (1) to 2"),
    (["+actor_infer.strategy_args.strategy_config.tensor_parallel_size=2", "actor_infer.num_cpus_per_worker=2",
      "+actor_infer.strategy_args.strategy_config.distributed_executor_backend=ray"],
     "distributed_executor_backend = 'ray'"),
    (["weight_sync_timeout_s=0"], "weight_sync_timeout_s: must be > 0"),
])
def test_scale_out_config_refusals(tmp_path, overrides, expected):
    from tests.test_config import problems

    assert expected in problems(tmp_path, overrides=overrides)


def test_tensor_parallel_with_enough_cores_and_collective_load(tmp_path):
    from tests.test_config import load

    cfg = load(tmp_path, overrides=["+actor_infer.strategy_args.strategy_config.tensor_parallel_size=2",
                                    "actor_infer.num_cpus_per_worker=2", "weight_sync_transport=collective"])
    assert cfg.weight_sync_transport == "collective"
