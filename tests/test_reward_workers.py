"""Reward workers without Ray: shared behaviour, killable timeouts, think handling, multiple
choice, validation accuracy. (Sandbox, judge and reward model have their own test files.)"""
import os
import subprocess
import threading
import time

import psutil
import pytest

from roll_gspo.schema.config import RewardConfig
from roll_gspo.distributed.batch import Batch
from roll_gspo.rewards import (RewardProcess, extract_choice, math_verify_reward, multiple_choice_reward,
                               score_many_with_timeout, unfinished_think)
from roll_gspo.rewards.shaping import decode_for_reward


def make_worker(cls, response_length=None, **cfg):
    """A reward worker built in this process (no Ray), its environment changes undone."""
    saved = dict(os.environ)
    try:
        worker = cls(RewardConfig(**cfg), domain="d", response_length=response_length,
                     dist_env={"RANK": 0, "WORLD_SIZE": 1, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": 1})
        worker.setup()
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return worker


def batch_of(prompts, responses, truths, response_ids=None):
    meta = {"prompt_text": list(prompts), "response_text": list(responses), "ground_truth": list(truths),
            "domain": ["d"] * len(prompts)}
    if response_ids is not None:
        meta["response_ids"] = response_ids
    return Batch(meta=meta)


# ------------------------------------------------------------------ 9.10 killable timeouts
def spin_forever(prompt, response, truth):
    if response == "spawn":  # a hung reward that also started a process of its own
        subprocess.Popen(["sleep", "1000"])
    while True:
        pass


def _cpu_seconds(proc):
    total = sum(proc.cpu_times()[:2])
    for child in proc.children(recursive=True):
        try:
            total += sum(child.cpu_times()[:2])
        except psutil.NoSuchProcess:
            pass
    return total


def test_hung_reward_is_killed_and_leaves_nothing_running():
    me = psutil.Process()
    threads_before = threading.active_count()
    children_before = {p.pid for p in me.children(recursive=True)}
    process = RewardProcess(spin_forever, timeout_s=0.2)
    calls = [("p", "spawn" if i % 5 == 0 else "r", "t") for i in range(20)]
    start = time.monotonic()
    outcomes = process.score_many(calls)
    elapsed = time.monotonic() - start
    assert [o[1] for o in outcomes] == ["timeout"] * 20 and all(o[0] == 0.0 for o in outcomes)
    assert process.kills == 20 and elapsed < 20 * 0.2 + 10
    time.sleep(0.3)
    assert threading.active_count() == threads_before  # no abandoned scoring threads
    leftover = [p for p in me.children(recursive=True) if p.pid not in children_before]
    assert leftover == [], [p.cmdline() for p in leftover]  # no hung child, no `sleep` it started
    used = _cpu_seconds(me)
    time.sleep(1.0)
    assert _cpu_seconds(me) - used < 0.3  # idle: nothing spins on
    # The scorer still works after its kills, with one fresh child that close() ends.
    ok = RewardProcess(lambda p, r, t: float(r == t), timeout_s=5)
    assert ok.score_many([("p", "a", "a"), ("p", "a", "b")]) == [(1.0, "ok", ""), (0.0, "ok", "")]
    assert [p.pid for p in me.children() if p.pid not in children_before] == [ok.pid]
    ok.close()
    assert [p for p in me.children(recursive=True) if p.pid not in children_before] == []


def test_reward_process_survives_a_dying_child():
    def dies(prompt, response, truth):
        if response == "die":
            os._exit(3)
        return 1.0

    outcomes = score_many_with_timeout(dies, [("p", "x", "t"), ("p", "die", "t"), ("p", "y", "t")], 5.0)
    assert [o[:2] for o in outcomes] == [(1.0, "ok"), (0.0, "error"), (1.0, "ok")]
    assert "died" in outcomes[1][2]


def test_worker_timeouts_are_killed_and_counted(tmp_path):
    from roll_gspo.workers.rewards import FunctionRewardWorker

    worker = make_worker(FunctionRewardWorker, reward_fn="tests.test_reward_workers:spin_or_score", timeout_s=0.3)
    try:
        out = worker.compute_scores(batch_of(["p"] * 4, ["1", "hang", "0", "1"], ["1"] * 4))
        assert out["scores"].tolist() == [1.0, 0.0, 0.0, 1.0]
        assert out["reward_status"] == ["ok", "timeout", "ok", "ok"]
        assert out["reward_correct"] == [1.0, 0.0, 0.0, 1.0]
    finally:
        worker.close()


def spin_or_score(prompt, response, truth):
    while response == "hang":
        pass
    return float(response == truth)


# ------------------------------------------------------------------ 9.5 unfinished reasoning
R1_PROMPT = "<|User|>What is 40+7?<|Assistant|><think>\n"


@pytest.mark.parametrize("prompt,response,expected", [
    (R1_PROMPT, "40 plus 7 is 47, so 47", 0.0),            # stopped inside the prompt's think block
    (R1_PROMPT, "40 plus 7 ... 47</think> The answer is 47", 1.0),
    (R1_PROMPT, "reasoning 12</think> 46", 0.0),
    ("What is 40+7?", "<think>40 plus 7 is 47", 0.0),        # its own think block, never closed
    ("What is 40+7?", "47", 1.0),
    ("<think>a</think> What is 40+7?", "47", 1.0),           # a closed block in the prompt opens nothing
])
def test_truncated_reasoning_scores_zero(prompt, response, expected):
    assert math_verify_reward(prompt, response, "47") == expected


def test_unfinished_reasoning_is_a_format_status():
    from roll_gspo.workers.rewards import MathRuleRewardWorker

    worker = make_worker(MathRuleRewardWorker, timeout_s=5)
    try:
        out = worker.compute_scores(batch_of([R1_PROMPT, R1_PROMPT, "1+1="], ["so 47", "ok</think>47", "2"],
                                             ["47", "47", "2"]))
        assert out["scores"].tolist() == [0.0, 1.0, 1.0]
        assert out["reward_status"] == ["format", "ok", "ok"]
    finally:
        worker.close()
    assert unfinished_think(R1_PROMPT, "x") and not unfinished_think("q", "x")


def test_decode_for_reward_keeps_special_think_tokens():
    from roll_gspo.builtin.tokenizer import build_tokenizer

    tok = build_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<think>", "</think>"]})
    ids = tok("<think>12</think>47", add_special_tokens=False)["input_ids"] + [tok.eos_token_id, tok.pad_token_id]
    assert tok.decode(ids, skip_special_tokens=True) == "1247"  # what the old decoding gave the reward
    assert decode_for_reward(tok, [ids]) == ["<think>12</think>47"]
    plain = build_tokenizer()
    plain_ids = plain("47", add_special_tokens=False)["input_ids"] + [plain.eos_token_id]
    assert decode_for_reward(plain, [plain_ids]) == ["47"]


# ------------------------------------------------------------------ shared behaviour
def test_length_penalty_and_format_pattern():
    from roll_gspo.workers.rewards import RegexMatchRewardWorker

    worker = make_worker(RegexMatchRewardWorker, response_length=10, response_length_penalty_coef=0.5,
                         format_pattern=r"^ANS \d+$", pattern=r"ANS (\d+)")
    out = worker.compute_scores(batch_of(["p"] * 3, ["ANS 7", "ANS 8", "7"], ["7"] * 3,
                                         response_ids=[[0] * 4, [0] * 10, [0] * 2]))
    assert out["scores"].tolist() == pytest.approx([1 - 0.5 * 0.4, -0.5, -0.1])
    assert out["reward_status"] == ["ok", "ok", "format"]
    assert out["reward_correct"] == [1.0, 0.0, 0.0]  # correctness is judged before the penalty
    worker.close()
    with pytest.raises(ValueError, match="response_length_penalty_coef"):
        make_worker(RegexMatchRewardWorker, response_length_penalty_coef=0.1)


# ------------------------------------------------------------------ multiple choice
@pytest.mark.parametrize("response,letter,strict", [
    ("so \\boxed{B}", "B", True), ("\\boxed{ (c) }", "C", True), ("\\boxed{\\text{D}}", "D", True),
    ("Answer: b", "B", False), ("The answer is (A).", "A", False), ("answer :  d", "D", False),
    ("I pick (C) over (A)... final (D)", "D", False), ("  b  ", "B", False), ("B.", "B", False),
    ("<think>maybe (A)</think> Answer: C", "C", False), ("no idea", None, False), ("", None, False),
    ("(A) or (B)? \\boxed{A}", "A", True),
])
def test_extract_choice(response, letter, strict):
    assert extract_choice(response) == (letter, strict)


def test_multiple_choice_reward_types():
    assert multiple_choice_reward("", "\\boxed{B}", "B") == 1.0
    assert multiple_choice_reward("", "\\boxed{b}", " (B) ", reward_type="soft") == 1.0
    assert multiple_choice_reward("", "Answer: B", "B", reward_type="soft") == 0.5
    assert multiple_choice_reward("", "Answer: B", "B", reward_type="hard") == 1.0
    assert multiple_choice_reward("", "Answer: C", "B", reward_type="soft") == 0.0
    assert multiple_choice_reward("", "nothing", "B") == 0.0


def test_multiple_choice_worker():
    from roll_gspo.workers.rewards import MultipleChoiceRewardWorker

    worker = make_worker(MultipleChoiceRewardWorker, reward_type="soft")
    out = worker.compute_scores(batch_of(["q"] * 3, ["\\boxed{A}", "Answer: A", "(B)"], ["A"] * 3))
    assert out["scores"].tolist() == [1.0, 0.5, 0.0] and out["reward_correct"] == [1.0, 0.0, 0.0]
    worker.close()
    with pytest.raises(ValueError, match="reward_type"):
        make_worker(MultipleChoiceRewardWorker, reward_type="strict")


# ------------------------------------------------------------------ 9.9 validation accuracy
def test_val_accuracy_is_an_accuracy():
    from pipelines.reward_scoring import accuracies as _accuracies

    got = _accuracies(["m", "m", "c", "rm"], [1.0, 0.0, 1.0, None])
    assert got == {"val/accuracy": pytest.approx(2 / 3), "val/m/accuracy": 0.5, "val/c/accuracy": 1.0}
    assert _accuracies(["rm"], [None]) == {}


# ------------------------------------------------------------------ config keys of the reward workers
def _load_with_reward(tmp_path, block):
    from omegaconf import OmegaConf

    from roll_gspo.config import load_config

    example = OmegaConf.load(str(__import__("pathlib").Path(__file__).resolve().parents[1] / "examples" /
                                 "example_gspo.yaml"))
    example.rewards = {"math_rule": block}
    path = tmp_path / "cfg.yaml"
    OmegaConf.save(example, path)
    return load_config(str(path))


@pytest.mark.parametrize("block,message", [
    ({"worker_cls": "roll_gspo.workers.rewards.CodeSandboxRewardWorker", "use_local": False},
     "remote code sandbox"),
    ({"worker_cls": "roll_gspo.workers.rewards.LLMJudgeRewardWorker"}, "judge_api_url"),
    ({"response_length_penalty_coef": -0.1}, "response_length_penalty_coef: must be >= 0"),
    ({"format_pattern": "(unclosed"}, "format_pattern: not a valid regex"),
    ({"reward_type": "strict"}, "reward_type"),
])
def test_reward_keys_that_cannot_act_are_refused(tmp_path, block, message):
    from roll_gspo.config import ConfigError

    with pytest.raises((ConfigError, ValueError), match=message):
        _load_with_reward(tmp_path, block)


def test_new_examples_pass_preflight():
    from pathlib import Path

    from roll_gspo.config import load_config, preflight

    for name in ("example_gspo_code.yaml", "example_gspo_multidomain.yaml"):
        cfg = load_config(str(Path(__file__).resolve().parents[1] / "examples" / name))
        preflight(cfg)
        assert all(r.worker_cls.startswith("roll_gspo.workers.rewards.") for r in cfg.rewards.values())
