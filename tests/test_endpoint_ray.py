"""The rollout endpoint in front of real rollout ranks (ActorInferWorker Ray actors, hf_infer): an
episode's turns stay on one rank, new episodes go to the least busy one, the ranks' own batch
calls (generate_turns) run beside the endpoint's requests, a weight update while the endpoint
serves makes requests wait, never fail."""
import asyncio
import os

import openai
import ray

from roll_gspo.distributed.batch import Batch, to_wire
from roll_gspo.strategies.engine import Sampling

from tests.test_pipeline_e2e import write_config


def test_endpoint_over_two_ray_ranks(tmp_path, tiny_model, ray_session):
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    from roll_gspo.schema.config import GeneratingArgs
    from roll_gspo.distributed.cluster import Cluster
    from roll_gspo.serving.backends import RayRankBackend
    from roll_gspo.serving.server import RolloutServer
    from roll_gspo.workers.actor_infer import ActorInferWorker

    cfg = write_config(tmp_path, tiny_model, actor_infer={"strategy_args": {"strategy_name": "hf_infer",
                                                                               "strategy_config": {}},
                                                           "world_size": 2, "num_cpus_per_worker": 0.1})
    infer = Cluster("actor_infer", ActorInferWorker, 2, 0.1, 0, init_args=(cfg,))
    try:
        ray.get(infer.setup_async())
        infer.execute_all("start_engine_loop")
        server = RolloutServer([RayRankBackend(w) for w in infer.workers], AutoTokenizer.from_pretrained(tiny_model),
                               model_name="tiny", sampling=Sampling(max_new_tokens=8, temperature=1.0),
                               sequence_length=256, template="chatml")
        address = server.start()

        async def episode(ac, i):
            messages = [{"role": "user", "content": f"e{i}"}]
            for turn in range(2):
                r = await ac.chat.completions.create(model="tiny", messages=messages, user=f"ep{i}", max_tokens=6)
                messages += [{"role": "assistant", "content": r.choices[0].message.content},
                             {"role": "user", "content": "more"}]

        async def main():
            ac = openai.AsyncOpenAI(base_url=address, api_key="x", max_retries=0)
            await asyncio.gather(*(episode(ac, i) for i in range(4)))

        asyncio.run(main())
        records = [server.take_episode(f"ep{i}") for i in range(4)]
        assert {r.rank for r in records} == {0, 1}  # load-balanced
        assert all(r.requests == 2 and r.reused_turns == 1 for r in records)  # sticky: the same rank's ids reused

        # The rank's own batch call goes through the loop beside the endpoint.
        turns = infer.workers[0].generate_turns.remote(
            Batch(meta={"prompt_ids": [[20, 21, 22]], "max_new_tokens": [4], "sample_seed": [1]}),
            GeneratingArgs(max_new_tokens=4, temperature=1.0))

        # A weight update (the same weights, a new version) while episodes are served: nothing fails.
        weights = list(load_file(os.path.join(tiny_model, "model.safetensors")).items())
        bucket = [(name, *to_wire(t)) for name, t in weights]  # an object-store bucket, as the sync sends one

        async def during_update():
            ac = openai.AsyncOpenAI(base_url=address, api_key="x", max_retries=0)
            update = asyncio.get_running_loop().run_in_executor(None, lambda: infer.execute_all(
                "load_weight_bucket", bucket, True, True, 3))
            results = await asyncio.gather(*(ac.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": f"u{i}"}], user=f"up{i}", max_tokens=8)
                for i in range(6)))
            await update
            return results

        results = asyncio.run(during_update())
        assert len(results) == 6 and ray.get(turns)["response_ids"]
        versions = [v for i in range(6) for v in server.take_episode(f"up{i}").segments[0].trajectory.token_weight_versions]
        assert set(versions) <= {0, 3}
        stats = ray.get(infer.workers[0].engine_loop_stats.remote())
        assert stats["steps"] > 0 and stats["in_flight"] == 0
        assert server.metrics()["engine_failures"] == 0
        server.stop()
    finally:
        infer.shutdown()
