"""Scoring prompt-group responses with the reward workers: each response to the reward block of its
data domain, the scores back into the batch, and the reward metrics (overall, per domain; validation
adds accuracy, pass@k and maj@k)."""
from __future__ import annotations

from typing import Dict, List, Optional

import ray
import torch

from roll_gspo.distributed.batch import Batch
from roll_gspo.distributed.cluster import Cluster, WorkerDiedError

from pipelines.setup import REWARD_WORKER_RESTARTS
from pipelines.sources import RewardFuture


class RewardScorer:
    """The reward clusters (block name -> cluster) and which block scores each data domain."""

    def __init__(self, clusters: Dict[str, Cluster], domain_of_worker: Dict[str, str]):
        self.clusters, self.domain_of_worker = clusters, domain_of_worker
        self.worker_restarts = 0  # since the last training step's metrics

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
                pending.append((rows, refs))
        return pending

    def collect(self, batch: Batch, pending: list) -> None:
        """Wait for the scores; adds tensor `scores` (B,) and meta `reward_status` / `reward_correct` /
        `reward_metrics` to the batch."""
        scores = torch.zeros(len(batch))
        statuses, correct, row_metrics = [""] * len(batch), [None] * len(batch), [None] * len(batch)
        restarts = 0
        for rows, refs in pending:
            try:
                result = Batch.concat(ray.get(refs))
            except ray.exceptions.RayActorError as exc:  # restarts exhausted
                raise WorkerDiedError(f"a reward worker died {REWARD_WORKER_RESTARTS} times; the last time: "
                                      f"{str(exc).splitlines()[0]}") from exc
            restarts += sum(result.meta.get("worker_restarted", []))
            scores[rows] = result["scores"]
            for i, status, right in zip(rows, result["reward_status"], result["reward_correct"]):
                statuses[i], correct[i] = status, right
            for i, named in zip(rows, result.meta.get("reward_metrics", ())):  # a custom worker may send none
                row_metrics[i] = named
        batch["scores"], batch["reward_status"], batch["reward_correct"] = scores, statuses, correct
        batch["reward_metrics"] = row_metrics
        self.worker_restarts += restarts

    def score(self, batch: Batch) -> None:
        """Score the batch and wait for it."""
        self.collect(batch, self.start(batch))

    def metrics(self, batch: Batch, prefix: str = "reward") -> Dict[str, float]:
        """`reward_metrics` of the batch; training steps also report the reward workers restarted
        since the last one."""
        metrics = reward_metrics(batch, prefix)
        if prefix == "reward":
            metrics["reward/worker_restarts"], self.worker_restarts = float(self.worker_restarts), 0
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
    code (roll_gspo.tasks.sample_metrics)."""
    from roll_gspo.rewards.answers import extract_answer
    from roll_gspo.tasks import grouped_sample_metrics

    answers = [extract_answer(text) for text in batch["response_text"]]
    found = grouped_sample_metrics(batch["domain"], batch["reward_correct"], answers, n)
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
