"""Scale-out runtime: tensor-parallel vLLM rollout inside Ray, the collective weight transport
(equality and failure modes) and their config checks."""
import pytest
import torch

from roll_gspo.strategies.vllm_tp import cpu_thread_binding
from roll_gspo.sync.collective import bucket_layout, pack_bucket, unpack_bucket


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
    from tests.config_helpers import problems

    assert expected in problems(tmp_path, overrides=overrides)


def test_tensor_parallel_with_enough_cores_and_collective_load(tmp_path):
    from tests.config_helpers import load

    cfg = load(tmp_path, overrides=["+actor_infer.strategy_args.strategy_config.tensor_parallel_size=2",
                                    "actor_infer.num_cpus_per_worker=2", "weight_sync_transport=collective"])
    assert cfg.weight_sync_transport == "collective"


class BucketSink:
    """A rollout rank's weight-receiving end (the real CollectiveReceiver) without an engine: it
    keeps what arrives; `stall` makes it never take the next broadcast."""

    def __init__(self):
        from roll_gspo.sync.collective import CollectiveReceiver

        self.receiver, self.got, self.stall = CollectiveReceiver(), [], False

    def node_id(self):
        import ray

        return ray.get_runtime_context().get_node_id()

    def weight_receivers(self):
        return 1

    def join_weight_group(self, *args):
        self.receiver.join(*args)

    def stall_next(self):
        self.stall = True

    def load_weight_bucket(self, meta, first, last):
        if self.stall:
            import time

            time.sleep(3600)
        self.got += self.receiver.receive(meta)

    def received(self):
        return self.got


def start_sinks(ray, count):
    # concurrency 2: `stall_next` must reach a sink whose previous load is still queued.
    sinks = [ray.remote(num_cpus=0.1, max_concurrency=2)(BucketSink).remote() for _ in range(count)]
    ray.get([s.node_id.remote() for s in sinks])  # started (slow on a busy machine) before any deadline runs
    return sinks


@pytest.mark.e2e
def test_collective_transport_delivers_every_bucket(ray_session):
    from roll_gspo.sync.broadcast import WeightSender

    sinks = start_sinks(ray_session, 2)
    sender = WeightSender(sinks, "collective", 1 << 20, timeout_s=60)
    buckets = [[("w1", torch.randn(8, 4)), ("b1", torch.randn(4).to(torch.bfloat16))], [("w2", torch.randn(3, 3))]]
    for index, bucket in enumerate(buckets):
        sender.send(bucket, first=index == 0, last=index == len(buckets) - 1)
    sent = [pair for bucket in buckets for pair in bucket]
    for got in ray_session.get([s.received.remote() for s in sinks]):
        assert [name for name, _ in got] == [name for name, _ in sent]
        assert all(torch.equal(a, b) for (_, a), (_, b) in zip(got, sent))
    for sink in sinks:
        ray_session.kill(sink)


@pytest.mark.e2e
@pytest.mark.parametrize("failure, expected", [("dies", "died"), ("stalls", "within weight_sync_timeout_s = 10 s")])
def test_collective_transport_fails_clearly_when_a_receiver_is_lost(ray_session, failure, expected):
    """A rollout worker that dies or stops answering mid-sync fails the sync with a WeightSyncError
    within the deadline instead of hanging the trainer."""
    from roll_gspo.sync.broadcast import WeightSender
    from roll_gspo.sync.collective import WeightSyncError

    sinks = start_sinks(ray_session, 2)
    sender = WeightSender(sinks, "collective", 1 << 20, timeout_s=10)
    bucket = [("w", torch.randn(64, 64))]
    sender.send(bucket, first=True, last=False)
    if failure == "dies":
        ray_session.kill(sinks[1])
    else:
        ray_session.get(sinks[1].stall_next.remote())
    with pytest.raises(WeightSyncError, match=expected):
        sender.send(bucket, first=False, last=True)
    for sink in sinks:
        ray_session.kill(sink)


@pytest.mark.e2e
@pytest.mark.parametrize("tp_size, transport, bucket_mb", [(2, "auto", 256.0), (2, "collective", 0.02)])
def test_weight_sync_reaches_every_tensor_parallel_worker(tmp_path, tiny_model, ray_session, tp_size, transport,
                                                          bucket_mb):
    """vLLM with TP workers in processes of their own inside the Ray actor: after each of two
    steps and syncs, its log-probs of fixed sequences equal the trainer's as tightly as the TP = 1
    test does (tests/test_pipeline_e2e.py), by shared memory and by the collective transport (in
    many buckets, so a layer's tensors span buckets)."""
    import ray

    from pipelines.rlvr_pipeline import make_prompt_group_source
    from pipelines.trainer_loop import TrainerLoop
    from roll_gspo.distributed.batch import Batch
    from tests.test_pipeline_e2e import write_config

    engine = {"max_model_len": 32, "enforce_eager": True, "tensor_parallel_size": tp_size}
    cfg = write_config(tmp_path, tiny_model, max_steps=2, weight_sync_transport=transport,
                       weight_sync_bucket_mb=bucket_mb, weight_sync_timeout_s=300,
                       actor_infer={"strategy_args": {"strategy_config": engine}, "num_cpus_per_worker": tp_size})
    pipeline = TrainerLoop(cfg, make_prompt_group_source)
    try:
        infer = pipeline.actor_infer.workers[0]
        assert ray.get(infer.weight_receivers.remote()) == tp_size
        fixed = Batch(meta={"prompt_ids": [[20, 21, 15, 22], [23, 24, 15], [25, 15, 26, 27, 28]],
                            "response_ids": [[20, 21, 1], [22, 1], [23, 24, 25, 1]]})
        pipeline._add_sequence_tensors(fixed)

        def gaps():
            vllm_rows = ray.get(infer.score.remote(fixed))
            trainer = pipeline.actor_train.dispatch("compute_log_probs", pipeline._view(fixed))["old_log_probs"]
            vllm = [torch.tensor(r) for r in vllm_rows]
            return vllm, max(float((v - trainer[i, :len(v)]).abs().max()) for i, v in enumerate(vllm))

        before, gap = gaps()
        print(f"TP {tp_size}, {transport}: before any sync, max |vLLM - trainer| log-prob = {gap:.2e}")
        assert gap < 1e-4
        for step in (1, 2):
            pipeline.step(step)  # generate, reward, train, sync
            after, gap = gaps()
            print(f"TP {tp_size}, {transport}: after sync {step}, max |vLLM - trainer| log-prob = {gap:.2e}")
            assert gap < 1e-4, (step, gap)  # float32 rounding (~5e-7 measured, TP 1 and 2 alike)
            assert max(float((a - b).abs().max()) for a, b in zip(after, before)) > 1e-3  # weights did change
            before = after
    finally:
        pipeline.shutdown()
