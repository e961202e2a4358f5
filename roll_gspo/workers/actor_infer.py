"""`actor_infer` role: rollout ranks that sample G responses per prompt (vLLM or hf_infer) and
take the trainer's weights after each step. The rank speaks to its engine only through the
`RolloutEngine` contract (roll_gspo.strategies.engine): requests submitted and waited for, weight
updates as sessions, sleep and wake, the weight sync's device routes."""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import ray
import torch

from roll_gspo.config.plan.run_plan import RunPlan, build_run_plan
from roll_gspo.schema.config import GeneratingArgs, PipelineConfig
from roll_gspo.distributed.batch import Batch, from_wire
from roll_gspo.distributed.cluster import RankWorker
from roll_gspo.rewards.shaping import decode_for_reward
from roll_gspo.strategies import engine_class
from roll_gspo.strategies.engine import RolloutEngine, Sampling, generate_groups
from roll_gspo.sync.broadcast import SharedSegmentReader


class ActorInferWorker(RankWorker):
    """One rollout rank: its engine (`self.strategy`, a `RolloutEngine`) and the weight sync's end."""

    strategy: RolloutEngine
    # The rollout endpoint's calls (serve_*) run beside the default group's one-at-a-time calls; so
    # does the driver's health probe (a busy rank answers it).
    ray_concurrency_groups = {"serve": 256, "health": 1}
    engine_loop = None

    def __init__(self, cfg: PipelineConfig, *, dist_env: Dict[str, Any], plan: Optional[RunPlan] = None):
        super().__init__(dist_env)
        self.cfg = cfg
        self.plan = plan if plan is not None else build_run_plan(cfg)  # the pipeline's; built here when used alone
        self.shared_weights = SharedSegmentReader()
        self.pool: Any = None  # the request pool of partial rollouts (k >= 2), made at the first advance
        self.set_up = False  # `strategy` and `tokenizer` exist (setup ran)

    def setup(self) -> None:
        from transformers import AutoTokenizer

        if self.set_up:  # a replaced rank's setup call sent again
            return
        cfg = self.cfg
        role = cfg.actor_infer
        seed = cfg.seed + 1000 * self.rank
        # The engine's options; one that has no use for one ignores it (hf_infer takes the seed alone).
        self.strategy = engine_class(role.strategy_args.strategy_name)(
            role, max_model_len=cfg.max_sequence_tokens(), seed=seed, weight_update=cfg.vllm_weight_update,
            sleep_level=self.plan.sleep_level,
            lora_rank=role.model_args.lora_rank if cfg.lora_sync == "adapter" and role.model_args.uses_lora() else None)
        self.tokenizer = AutoTokenizer.from_pretrained(role.model_args.model_name_or_path)
        self.set_up = True

    @ray.method(concurrency_group="health")
    def health(self) -> Tuple[int, int]:
        """(engine steps so far, requests in flight), answered beside a running call: the driver's
        hang check (roll_gspo.distributed.fault_tolerance.HangWatch). (0, 0) before `setup`. With
        the engine loop running: the loop's own counts (asking the engine would pause the loop)."""
        if self.engine_loop is not None:
            return self.engine_loop.steps, self.engine_loop.in_flight()
        return self.strategy.progress() if self.set_up else (0, 0)

    def generate(self, prompts: Batch, gen: GeneratingArgs) -> Batch:
        """prompts: one row per prompt (meta prompt_ids, ground_truth, ...). Returns one row per
        response (n = gen.num_return_sequences consecutive rows per prompt) with meta
        response_ids / response_text / finished / weight_version (the pipeline step of the weights
        that sampled its oldest token) / token_weight_versions (that of each token) and tensor
        rollout_log_probs (B, T). With meta `sample_seed` (one per prompt,
        `roll_gspo.lifecycle.seeding`), sampling depends on it alone: response j of a prompt is
        one request seeded sample_seed + j."""
        n = gen.num_return_sequences
        groups = generate_groups(self.strategy, prompts["prompt_ids"], Sampling.of(gen), n,
                                 prompts.meta.get("sample_seed") or None)
        return self._rows([{key: prompts.meta[key][index] for key in prompts.meta} for index in range(len(groups))],
                          groups, list(prompts.meta))

    def _rows(self, metas: List[Dict[str, Any]], groups: List[List[Any]], keys: List[str]) -> Batch:
        """One row per response of each prompt's `groups` entry (outputs with token_ids,
        log_probs, weight_versions, weight_version, finish_reason), with the prompt's meta `keys`."""
        rows: Dict[str, List[Any]] = {key: [] for key in keys}
        rows.update(response_ids=[], finished=[])
        log_probs, versions, token_versions = [], [], []
        for meta, outputs in zip(metas, groups):
            for out in outputs:
                for key in keys:
                    rows[key].append(meta[key])
                rows["response_ids"].append(out.token_ids)
                rows["finished"].append(out.finish_reason == "stop")
                versions.append(out.weight_version)
                token_versions.append(out.weight_versions)
                log_probs.append(out.log_probs)
        width = max((len(r) for r in log_probs), default=0)
        tensor = torch.zeros(len(log_probs), width)
        for i, row in enumerate(log_probs):
            tensor[i, : len(row)] = torch.tensor(row)
        # Special tokens go, but not `<think>` / `</think>`: rewards must see unfinished reasoning.
        rows["response_text"] = decode_for_reward(self.tokenizer, rows["response_ids"])
        rows["weight_version"], rows["token_weight_versions"] = versions, token_versions
        return Batch({"rollout_log_probs": tensor}, rows)

    # -- partial rollouts (async_generation_ratio k >= 2; roll_gspo.strategies.request_pool) ----------
    def advance(self, prompts: Batch, quota: int, step: int, bound: int, gen: GeneratingArgs,
                with_state: bool = False) -> tuple:
        """The rank's request pool: continue its held groups, add `prompts` (one row per prompt, as
        `generate` takes them) as new groups, return the first `quota` complete groups as
        `generate`'s rows (for the step `step`, within `bound` versions) and the call's counts;
        `with_state`: and the pool's state after the call (`pool_state`: the driver keeps it for a
        process that replaces this one)."""
        from roll_gspo.strategies.request_pool import RequestPool

        if self.pool is None:
            self.pool = RequestPool(self.strategy)
        rows = [{key: prompts.meta[key][i] for key in prompts.meta} for i in range(len(prompts))]
        groups, counts = self.pool.advance(rows, quota, step, bound, Sampling.of(gen), gen.num_return_sequences)
        keys = list(groups[0].meta) if groups else list(prompts.meta)
        rows = self._rows([g.meta for g in groups], [g.requests for g in groups], keys)
        return (rows, counts.as_dict(), self.pool.state()) if with_state else (rows, counts.as_dict())

    def pool_state(self) -> Optional[Dict[str, Any]]:
        """The request pool's held groups (None before the first `advance`): what a checkpoint saves."""
        return self.pool.state() if self.pool is not None else None

    def load_pool_state(self, state: Optional[Dict[str, Any]]) -> None:
        """The held groups a checkpoint saved, continued by the next `advance`."""
        from roll_gspo.strategies.request_pool import RequestPool

        self.pool = RequestPool(self.strategy)
        if state is not None:
            self.pool.load_state(state)

    def generate_turns(self, requests: Batch, gen: GeneratingArgs) -> Batch:
        """One turn of each of several episodes (the agentic pipeline). requests: meta prompt_ids
        (the episode's whole context), max_new_tokens (this turn's cap), sample_seed. Returns meta
        response_ids, log_probs (per token, lists), weight_version (the oldest token's) and
        token_weight_versions, in request order; one sample per request. Requests with the same
        cap are submitted and waited for together, the smallest cap first."""
        count = len(requests)
        outputs: List[Any] = [None] * count
        by_cap: Dict[int, List[int]] = {}
        for i, cap in enumerate(requests["max_new_tokens"]):
            by_cap.setdefault(int(cap), []).append(i)
        for cap, rows in sorted(by_cap.items()):
            groups = generate_groups(self.strategy, [requests["prompt_ids"][i] for i in rows],
                                     Sampling.of(gen, max_new_tokens=cap), 1,
                                     [requests["sample_seed"][i] for i in rows])
            for i, (out,) in zip(rows, groups):
                outputs[i] = out
        return Batch(meta={"response_ids": [list(out.token_ids) for out in outputs],
                           "log_probs": [list(out.log_probs) for out in outputs],
                           "weight_version": [out.weight_version for out in outputs],
                           "token_weight_versions": [out.weight_versions for out in outputs]})

    def offload_states(self) -> Dict[str, float]:
        """After the generation phase, when roles share GPUs: the engine sleeps (a no-op where
        that frees nothing). Returns this rank's memory before and after, in GiB."""
        from roll_gspo.placement.colocation import memory_gb

        before = memory_gb()
        self.strategy.sleep()
        return {"memory/actor_infer_generate_gb": before, "memory/actor_infer_sleep_gb": memory_gb()}

    def score(self, batch: Batch) -> List[List[float]]:
        """The engine's log-probs of given responses (used to verify weight sync)."""
        return self.strategy.score(batch["prompt_ids"], batch["response_ids"])

    def load_adapter(self, payload, config: Dict[str, Any], version: Optional[int] = None) -> None:
        """`lora_sync: adapter`: the trainer's LoRA adapter (tensors under PEFT's names, as
        `broadcast_adapter` sends them, and its adapter_config.json content), which generation then
        applies; `version` is stamped on the tokens sampled from then on."""
        self.strategy.load_adapter([(name, from_wire(array, tag)) for name, array, tag in payload], config, version)

    def load_weight_bucket(self, bucket, first: bool, last: bool, version: Optional[int] = None) -> None:
        """One bucket of a weight sync (checkpoint naming), by either transport of `weight_sync`;
        `first` and `last` open and close the engine's update session; the last one's `version`
        (pipeline step of the weights) is stamped on the tokens sampled from then on."""
        if first:
            self.strategy.begin_weight_update()
        self.strategy.load_bucket(bucket, self.shared_weights)
        if last:
            self.strategy.finish_weight_update(version)
            self.shared_weights.close()  # the trainer frees the segment after the sync's last bucket

    # -- weight sync on devices (CUDA IPC, NCCL or gloo group) --------------------------------------
    def weight_receivers(self) -> int:
        """Processes of this rank that hold weights: one per vLLM TP worker (or itself)."""
        return self.strategy.weight_receivers()

    def weight_gpus(self) -> List[Optional[str]]:
        """The GPU (UUID; None on CPU) of each process of this rank that holds weights: where the
        trainer's weight sync decides its route (roll_gspo.placement.weight_routes)."""
        return self.strategy.weight_gpus()

    def join_weight_group(self, host: str, port: int, first_rank: int, world_size: int, timeout_s: float,
                          backend: str, members: Optional[List[Optional[int]]] = None) -> None:
        """Join the weight-sync group; `members`: each worker's group rank (None: it takes buckets
        by CUDA IPC), when not simply first_rank + its index."""
        self.strategy.join_weight_group(host, port, first_rank, world_size, timeout_s, backend, members)

    # -- the rollout endpoint (roll_gspo.serving): continuous batching --------------------------------
    def start_engine_loop(self) -> None:
        """Drive the engine from a background loop (roll_gspo.strategies.engine_loop) from now on:
        endpoint requests and this rank's own batch calls join one running batch; weight updates and
        other engine calls pause it at a step boundary."""
        if self.engine_loop is None:
            from roll_gspo.strategies.engine_loop import EngineLoop, LoopedEngine

            self.engine_loop = EngineLoop(self.strategy)
            self.strategy = LoopedEngine(self.engine_loop)  # type: ignore[assignment]

    @ray.method(concurrency_group="serve")
    def serve_generate(self, request_id: str, prompt_ids: List[int], sampling, seed: Optional[int] = None):
        """One endpoint request (token ids in): its `RequestOutput` (ids, log-probs, weight versions)."""
        if self.engine_loop is None:
            raise RuntimeError("the engine loop is not running on this rank (start_engine_loop)")
        return self.engine_loop.submit(request_id, prompt_ids, sampling, seed).result()

    @ray.method(concurrency_group="serve")
    def serve_abort(self, request_ids: List[str]) -> None:
        if self.engine_loop is not None:
            self.engine_loop.abort(request_ids)

    @ray.method(concurrency_group="serve")
    def engine_loop_stats(self) -> Dict[str, float]:
        """Engine steps, busy seconds and busy fraction of this rank's loop."""
        loop = self.engine_loop
        if loop is None:
            return {}
        return {"steps": float(loop.steps), "busy_s": loop.busy_s, "busy_fraction": loop.busy_fraction(),
                "in_flight": float(loop.in_flight())}
