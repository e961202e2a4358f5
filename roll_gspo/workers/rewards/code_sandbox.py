"""Code sandbox reward (ROLL's `CodeSandboxRewardWorker`, local mode)."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any, List, Sequence

from roll_gspo.distributed.batch import Batch
from roll_gspo.rewards.code_sandbox import Sandbox, code_outcome, run_tests
from roll_gspo.rewards.scoring import Outcome
from roll_gspo.workers.rewards.base import RewardWorker


class CodeSandboxRewardWorker(RewardWorker):
    """Runs each response's code against its row's tests (ground truth: `{"case_type": "assert" |
    "input", "test_cases": [...]}`), one sandboxed program per test (`sandbox`, `timeout_s` per
    program, `sandbox_memory_mb`, `sandbox_max_processes`). `reward_type: soft` scores the
    fraction of tests passed, `hard` (default) 1 only when all pass. `reward_kwargs.python`: the
    interpreter the programs run with (default: this one); `reward_kwargs.site_packages: true`
    lets programs import installed packages (slower start; default: the standard library only);
    `reward_kwargs.parallel`: programs run at once (default: the worker's reserved CPUs, at
    least 1)."""

    def build_reward_fn(self):
        cfg = self.cfg
        if not cfg.use_local or cfg.code_url:
            raise ValueError(f"rewards.{self.domain}: only the local sandbox is built (use_local: true, no code_url)")
        self.reward_type = cfg.reward_type or "hard"
        kwargs = self.reward_kwargs()
        self.sandbox = Sandbox(cfg.sandbox, timeout_s=cfg.timeout_s, memory_mb=cfg.sandbox_memory_mb,
                               max_processes=cfg.sandbox_max_processes, python=kwargs.get("python"),
                               site_packages=bool(kwargs.get("site_packages", False)))
        self.parallel = int(kwargs.get("parallel") or max(1, round(cfg.num_cpus_per_worker)))
        return None  # scores whole batches in score_responses

    def score_one(self, response: str, ground_truth: Any) -> Outcome:
        try:
            results = run_tests(self.sandbox, response, ground_truth, stop_on_failure=self.reward_type == "hard")
            return code_outcome(results, self.reward_type)
        except (ValueError, TypeError, KeyError, AttributeError) as exc:  # a malformed test spec
            return 0.0, "error", f"bad code ground truth: {type(exc).__name__}: {exc}"

    def score_responses(self, prompts: Sequence[str], responses: Sequence[str], truths: Sequence[Any],
                        batch: Batch) -> List[Outcome]:
        if self.parallel <= 1:
            return [self.score_one(r, t) for r, t in zip(responses, truths)]
        with ThreadPoolExecutor(self.parallel) as pool:
            return list(pool.map(self.score_one, responses, truths))
