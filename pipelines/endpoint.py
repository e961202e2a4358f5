"""The run's rollout endpoint (`rollout_endpoint`, docs/endpoint.md): started in front of the rollout
ranks once they are up, its address printed on the console, stopped with the run."""
from __future__ import annotations

import logging
from typing import Optional

from roll_gspo.schema.config import PipelineConfig
from roll_gspo.config.plan.endpoint import serves_endpoint, uses_agent

from pipelines.setup import RunClusters

logger = logging.getLogger("roll_gspo")


def endpoint_sampling(cfg: PipelineConfig):
    """What the endpoint samples with: the rollout's generating_args (agentic: the training env
    manager's, max_new_tokens per turn), as the trainer's ratio assumes."""
    from roll_gspo.config.plan.agentic import manager_generating_args
    from roll_gspo.strategies.engine import Sampling

    gen = (manager_generating_args(cfg, cfg.train_env_manager) if cfg.pipeline == "agentic"
           else cfg.actor_infer.generating_args)
    return Sampling.of(gen, max_new_tokens=gen.max_new_tokens or cfg.response_length)


def episode_bounds(cfg: PipelineConfig) -> dict:
    """What the endpoint records: only an agent run trains on (and takes) its episodes, so only it
    keeps them; its live records are the step's episodes (verifiers: a few traces each), bounded
    with room to spare so a client's stray ids are evicted, never the step's."""
    return {"keep_records": uses_agent(cfg), "max_episodes": max(1024, 4 * cfg.rollout_batch_size)}


def start_endpoint(cfg: PipelineConfig, clusters: RunClusters, tokenizer):
    """The endpoint over every rollout rank (each now runs its engine loop), started; None when the
    run serves none. Prints `rollout endpoint: http://HOST:PORT/v1`."""
    if not serves_endpoint(cfg):
        return None
    from roll_gspo.serving.backends import RayRankBackend
    from roll_gspo.serving.server import RolloutServer

    ep = cfg.rollout_endpoint
    clusters.actor_infer.execute_all("start_engine_loop")
    server = RolloutServer([RayRankBackend(w) for w in clusters.actor_infer.workers], tokenizer,
                           model_name=ep.model_name, sampling=endpoint_sampling(cfg),
                           sequence_length=cfg.max_sequence_tokens(), template=cfg.actor_train.data_args.template,
                           host=ep.host, port=ep.port, token=ep.token, tool_parser=ep.tool_parser,
                           **episode_bounds(cfg))
    address = server.start()
    logger.info("rollout endpoint: %s (model %r, %d rollout rank%s)", address, ep.model_name,
                clusters.actor_infer.world_size, "" if clusters.actor_infer.world_size == 1 else "s")
    return server


def stop_endpoint(server: Optional[object]) -> None:
    """Stop serving (the run is ending); nothing when the run served none."""
    if server is not None:
        server.stop()
