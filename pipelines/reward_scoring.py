"""Scoring prompt-group responses with the reward workers: each response to the reward block of its
data domain, the scores back into the batch, and the reward metrics (overall, per domain; validation
adds accuracy, pass@k and maj@k)."""
from __future__ import annotations

import logging
import time
from typing import Dict, List, Optional, Tuple

import ray
import torch

from roll_gspo.distributed.batch import Batch
from roll_gspo.distributed.cluster import Cluster, RestartsExhaustedError
from roll_gspo.distributed.fault_tolerance import METRIC_PREFIX
from roll_gspo.schema.config import FaultToleranceConfig
from roll_gspo.utils.logging import log_path

from pipelines.sources import RewardFuture

logger = logging.getLogger("roll_gspo")


class RewardScorer:
    """The reward clusters (block name -> cluster) and which block scores each data domain.

    A worker whose process dies is restarted by Ray (`fault_tolerance.max_restarts` times per
    worker) and its unfinished call retried; a worker whose call runs past
    `fault_tolerance.reward_timeout_s` is hung: killed, and so restarted and its call retried too.
    Either way the restarted worker says so in its first answer: counted in `reward/worker_restarts`
    and `fault/restarts/reward_<block>`, one console line each."""

    def __init__(self, clusters: Dict[str, Cluster], domain_of_worker: Dict[str, str],
                 fault: Optional[FaultToleranceConfig] = None):
        self.clusters, self.domain_of_worker = clusters, domain_of_worker
        fault = fault or FaultToleranceConfig()
        self.timeout_s, self.max_restarts = fault.reward_timeout_s, fault.max_restarts
        self.worker_restarts = 0  # since the last training step's metrics
        self.restarts: Dict[str, int] = {}  # per block, since the last training step's metrics
        self.restarted: Dict[Tuple[str, int], int] = {}  # per worker, over the run
        self.killed: Dict[Tuple[str, int], str] = {}  # workers killed as hung, not yet seen restarted: why

    def future(self, batch: Batch) -> RewardFuture:
        """The batch's rewards, to start while the log-prob passes run; awaiting them returns the
        `reward/*` metrics."""
        def finish(pending: list) -> Dict[str, float]:
            self.collect(batch, pending)
            return self.metrics(batch)

        return RewardFuture(lambda: self.start(batch), finish)

    def start(self, batch: Batch) -> list:
        """Send every response (its meta: texts, token ids, ground truth, domain; not the trainer's
        tensors) to its domain's reward cluster; returns what to `collect`."""
        responses = Batch(meta=batch.meta)
        pending = []
        for name, cluster in self.clusters.items():
            rows = [i for i, d in enumerate(batch["domain"]) if self.domain_of_worker[d] == name]
            if rows:
                shards = responses.select(rows).chunk(cluster.world_size)
                refs = [w.compute_scores.remote(s) for w, s in zip(cluster.workers, shards)]
                pending.append((name, rows, refs, time.monotonic()))
        return pending

    def collect(self, batch: Batch, pending: list) -> None:
        """Wait for the scores; adds tensor `scores` (B,) and meta `reward_status` / `reward_correct` /
        `reward_metrics` to the batch."""
        scores = torch.zeros(len(batch))
        statuses, correct, row_metrics = [""] * len(batch), [None] * len(batch), [None] * len(batch)
        for name, rows, refs, started in pending:
            result = Batch.concat(self._await(name, refs, started))
            scores[rows] = result["scores"]
            for i, status, right in zip(rows, result["reward_status"], result["reward_correct"]):
                statuses[i], correct[i] = status, right
            for i, named in zip(rows, result.meta.get("reward_metrics", ())):  # a custom worker may send none
                row_metrics[i] = named
        batch["scores"], batch["reward_status"], batch["reward_correct"] = scores, statuses, correct
        batch["reward_metrics"] = row_metrics

    def _await(self, name: str, refs: List, started: float) -> List[Batch]:
        """Each worker's scored shard; a call past the deadline is a hung worker: killed (Ray restarts
        it and retries the call there, with a deadline of its own)."""
        cluster, refs = self.clusters[name], list(refs)
        deadlines = [started + self.timeout_s] * len(refs)
        out: List[Optional[Batch]] = [None] * len(refs)
        pending = set(range(len(refs)))
        while pending:
            wait = max(0.0, min(deadlines[i] for i in pending) - time.monotonic())
            ready, _ = ray.wait([refs[i] for i in pending], num_returns=len(pending), timeout=wait)
            for i in [i for i in pending if refs[i] in ready]:
                out[i] = self._get(name, i, refs[i])
                self._count_restart(name, i, out[i])
                pending.discard(i)
            now = time.monotonic()
            for i in [i for i in pending if deadlines[i] <= now]:
                self.killed[(name, i)] = f"its call ran past fault_tolerance.reward_timeout_s = {self.timeout_s:g} s"
                # Said now; the restart's own line follows its first answer (_count_restart).
                logger.warning("reward worker reward_%s rank %d is hung: %s; killed, Ray restarts it and its "
                               "responses are scored again", name, i, self.killed[(name, i)])
                # Ray restarts it (within max_restarts) and runs the call again there (max_task_retries).
                ray.kill(cluster.workers[i], no_restart=False)
                deadlines[i] = now + self.timeout_s
        return [batch for batch in out if batch is not None]

    def _get(self, name: str, rank: int, ref) -> Batch:
        try:
            return ray.get(ref)
        except ray.exceptions.RayActorError as exc:  # restarts exhausted
            why = self.killed.get((name, rank), "its process died")
            output = log_path(f"reward_{name}-{rank}", "*")  # each of its processes wrote its own file
            raise RestartsExhaustedError(
                f"reward worker reward_{name} rank {rank} was lost once more than fault_tolerance.max_restarts = "
                f"{self.max_restarts} allows (the last time: {why}; {str(exc).strip().splitlines()[0]}). "
                + (f"Its output: {output}. " if output else "")
                + "The run stops; its last complete checkpoint is intact (resume with resume_from_checkpoint=auto)"
            ) from exc

    def _count_restart(self, name: str, rank: int, shard: Batch) -> None:
        """A restarted worker's first answer (one row flagged): counted, one console line."""
        if not sum(shard.meta.get("worker_restarted", [])):
            return
        count = self.restarted[(name, rank)] = self.restarted.get((name, rank), 0) + 1
        why = self.killed.pop((name, rank), "its process died")
        logger.warning("reward worker reward_%s rank %d restarted (%s; restart %d of %d for this worker); its "
                       "responses were scored again", name, rank, why, count, self.max_restarts)
        self.worker_restarts += 1
        self.restarts[name] = self.restarts.get(name, 0) + 1

    def score(self, batch: Batch) -> None:
        """Score the batch and wait for it."""
        self.collect(batch, self.start(batch))

    def metrics(self, batch: Batch, prefix: str = "reward") -> Dict[str, float]:
        """`reward_metrics` of the batch; training steps also report the reward workers restarted
        since the last one."""
        metrics = reward_metrics(batch, prefix)
        if prefix == "reward":
            metrics["reward/worker_restarts"], self.worker_restarts = float(self.worker_restarts), 0
            metrics.update({f"{METRIC_PREFIX}reward_{name}": float(self.restarts.pop(name, 0))
                            for name in self.clusters})
        return metrics


def reward_metrics(batch: Batch, prefix: str) -> Dict[str, float]:
    """Reward metrics of a scored batch, overall and per data domain (`<prefix>/<domain>/mean`,
    `.../errors`, `.../timeouts`, `.../format`, and the means of the numbers its worker reports per
    response, e.g. IFEval's accuracies)."""
    scores, statuses = batch["scores"], batch["reward_status"]
    row_metrics = batch["reward_metrics"] if "reward_metrics" in batch else [None] * len(batch)
    metrics = _score_summary(prefix, scores, statuses)
    domains = batch["domain"]
    for domain in sorted(set(domains)):
        rows = [i for i, d in enumerate(domains) if d == domain]
        metrics.update(_score_summary(f"{prefix}/{domain}", scores[rows], [statuses[i] for i in rows]))
        metrics.update(_row_metric_means(f"{prefix}/{domain}", [row_metrics[i] for i in rows]))
    return metrics


def accuracies(domains: List[str], correct: List) -> Dict[str, float]:
    """`val/accuracy`: the fraction of responses whose reward worker judged them correct (raw
    score at full marks, before length penalties), overall and per domain; domains whose worker
    has no notion of correct (a reward model) are left out."""
    def fraction(flags):
        flags = [f for f in flags if f is not None]
        return {"accuracy": sum(flags) / len(flags)} if flags else {}

    out = {f"val/{k}": v for k, v in fraction(correct).items()}
    for domain in sorted(set(domains)):
        flags = [c for d, c in zip(domains, correct) if d == domain]
        out.update({f"val/{domain}/{k}": v for k, v in fraction(flags).items()})
    return out


def sample_metrics(batch: Batch, n: int) -> Dict[str, float]:
    """`val/pass@k` and `val/maj@k` (n samples per prompt; k = 1, 2, 4, .., n), overall and per
    domain, from the workers' verdicts and the replies' extracted answers: the evaluation command's
    code (roll_gspo.tasks.sample_metrics). Per domain with a notion of correct, also
    `top_answer_share` and `constant_answer_accuracy` (`answer_spread`): accuracy that rose because
    the policy gives one answer to every prompt shows there."""
    from roll_gspo.rewards.answers import extract_answer
    from roll_gspo.tasks import answer_spread, grouped_sample_metrics, reference_answer

    answers = [extract_answer(text) for text in batch["response_text"]]
    found = grouped_sample_metrics(batch["domain"], batch["reward_correct"], answers, n)
    judged = [i for i, c in enumerate(batch["reward_correct"]) if c is not None]
    found.update(answer_spread([batch["domain"][i] for i in judged], [answers[i] for i in judged],
                               [reference_answer(batch["ground_truth"][i]) for i in judged]))
    return {f"val/{k}": v for k, v in found.items()}


def _score_summary(prefix: str, scores: torch.Tensor, statuses: List[str]) -> Dict[str, float]:
    """Mean and spread of the scores, and how many responses ended in an error, a timeout, a format failure."""
    return {f"{prefix}/mean": float(scores.mean()),
            f"{prefix}/std": float(scores.std()) if len(scores) > 1 else 0.0,
            f"{prefix}/errors": float(statuses.count("error")), f"{prefix}/timeouts": float(statuses.count("timeout")),
            f"{prefix}/format": float(statuses.count("format"))}


def _row_metric_means(prefix: str, rows: List[Optional[Dict[str, float]]]) -> Dict[str, float]:
    """`<prefix>/<name>`: the mean of each number reward workers reported per response, over the
    responses that reported it."""
    values: Dict[str, List[float]] = {}
    for named in rows:
        for name, value in (named or {}).items():
            values.setdefault(name, []).append(value)
    return {f"{prefix}/{name}": sum(vs) / len(vs) for name, vs in values.items()}
