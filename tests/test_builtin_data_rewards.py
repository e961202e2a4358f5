"""Built-in model/tasks, data loading and reward functions. Fast (no Ray); vLLM in a subprocess."""
import json
import math
import os
import subprocess
import sys
import textwrap
import time

import pytest

from roll_gspo import builtin, rewards
from roll_gspo.data import prompts as data


@pytest.fixture(scope="session", autouse=True)
def cache_dir(tmp_path_factory):
    """Point the roll_gspo cache at a temp folder so tests never touch ~/.cache."""
    path = str(tmp_path_factory.mktemp("roll_gspo_cache"))
    old = os.environ.get(builtin.CACHE_ENV)
    os.environ[builtin.CACHE_ENV] = path
    yield path
    if old is None:
        os.environ.pop(builtin.CACHE_ENV, None)
    else:
        os.environ[builtin.CACHE_ENV] = old


@pytest.fixture(scope="session")
def tokenizer():
    return builtin.build_tokenizer()


@pytest.fixture(scope="session")
def base_model(cache_dir):
    return builtin.resolve_model("builtin:tiny-arith-base")


# ------------------------------------------------------------------------------ builtin
def test_tokenizer_round_trip(tokenizer):
    text = "12+35=47 (x-3)*4/2 Hello, World: ok?!\n"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text)  # one token per character
    assert tokenizer.decode(ids) == text
    assert tokenizer.eos_token == "<eos>" and tokenizer.pad_token == "<pad>"
    assert tokenizer.eos_token_id != tokenizer.pad_token_id
    with_eos = ids + [tokenizer.eos_token_id]
    assert tokenizer.decode(with_eos, skip_special_tokens=True) == text
    msgs = [{"role": "user", "content": "1+2="}]
    assert tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == "1+2="


def test_base_model_loads_in_transformers(base_model, cache_dir):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert base_model.startswith(cache_dir)
    model = AutoModelForCausalLM.from_pretrained(base_model)
    tok = AutoTokenizer.from_pretrained(base_model)
    cfg = model.config
    assert cfg.model_type == "qwen2" and cfg.hidden_size // cfg.num_attention_heads == 32
    assert cfg.vocab_size == len(tok) and cfg.eos_token_id == tok.eos_token_id
    assert os.path.exists(os.path.join(base_model, "model.safetensors"))
    enc = tok("12+35=", return_tensors="pt")
    torch.manual_seed(0)
    out = model.generate(**enc, max_new_tokens=5, do_sample=True)
    assert out.shape[1] > enc["input_ids"].shape[1]
    # Reused, not rebuilt, on the second resolve.
    mtime = os.path.getmtime(os.path.join(base_model, "model.safetensors"))
    assert builtin.resolve_model("builtin:tiny-arith-base") == base_model
    assert os.path.getmtime(os.path.join(base_model, "model.safetensors")) == mtime


def test_build_base_model_deterministic(tmp_path):
    from safetensors.torch import load_file

    a = builtin.build_base_model(str(tmp_path / "a"), seed=3, size="micro")
    b = builtin.build_base_model(str(tmp_path / "b"), seed=3, size="micro")
    wa, wb = load_file(os.path.join(a, "model.safetensors")), load_file(os.path.join(b, "model.safetensors"))
    assert wa.keys() == wb.keys() and all((wa[k] == wb[k]).all() for k in wa)
    assert not [p for p in os.listdir(tmp_path) if ".tmp-" in p]  # temp folders renamed away


def test_resolve_model_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.*pretrain"):
        builtin.resolve_model(str(tmp_path / "nope"))
    with pytest.raises(ValueError, match="builtin:tiny-arith-base"):
        builtin.resolve_model("builtin:no-such-model")
    builtin.register_builtin_model("builtin:test-unbuildable", None)
    try:
        with pytest.raises(RuntimeError, match="no builder"):
            builtin.resolve_model("builtin:test-unbuildable", cache_dir=str(tmp_path))
    finally:
        del builtin.BUILTIN_MODELS["builtin:test-unbuildable"]
    assert builtin.resolve_model(str(tmp_path)) == str(tmp_path)


def test_the_warm_starts_are_built_by_the_pipelines_which_register_them_at_start_up():
    """roll_gspo.builtin names the warm starts without a builder (building one runs a pipeline, a layer
    above); importing `pipelines` registers them."""
    import pipelines  # noqa: F401
    from pipelines.warm_start import build_tiny_arith, build_tiny_calculator, build_tiny_frozenlake, build_tiny_moe

    builders = {name: builtin.BUILTIN_MODELS[name].builder for name in
                ("builtin:tiny-arith", "builtin:tiny-moe", "builtin:tiny-frozenlake", "builtin:tiny-calculator")}
    assert builders == {"builtin:tiny-arith": build_tiny_arith, "builtin:tiny-moe": build_tiny_moe,
                        "builtin:tiny-frozenlake": build_tiny_frozenlake, "builtin:tiny-calculator": build_tiny_calculator}


def test_register_builder_hook(tmp_path):
    calls = []

    def builder(folder, cache_dir=None):
        calls.append(cache_dir)
        with open(os.path.join(folder, "marker"), "w") as fh:
            fh.write("ok")

    builtin.register_builtin_model("builtin:test-hook", builder)
    try:
        folder = builtin.resolve_model("builtin:test-hook", cache_dir=str(tmp_path))
        assert open(os.path.join(folder, "marker")).read() == "ok"
        assert builtin.resolve_model("builtin:test-hook", cache_dir=str(tmp_path)) == folder
        assert calls == [str(tmp_path)]  # built once, then reused
    finally:
        builtin.BUILTIN_MODELS.pop("builtin:test-hook")


def test_failed_build_leaves_nothing(tmp_path):
    def broken(folder):
        open(os.path.join(folder, "half"), "w").close()
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        builtin.build_atomically(str(tmp_path / "m"), broken)
    assert os.listdir(tmp_path) == ["m.lock"]


def test_arith_tasks_deterministic_and_disjoint():
    a = builtin.make_arith_samples(500, seed=1)
    assert a == builtin.make_arith_samples(500, seed=1)
    assert a != builtin.make_arith_samples(500, seed=2)
    for r in a:
        assert r["domain"] == "math_rule" and r["prompt"].endswith("=")
        assert str(eval(r["prompt"][:-1].replace("/", "//"))) == r["ground_truth"]
    assert {r["level"] for r in a} == set(builtin.ARITH_LEVELS)
    assert any(r["ground_truth"].startswith("-") for r in a)
    only2 = builtin.make_arith_samples(50, seed=0, levels=[2])
    assert {r["level"] for r in only2} == {2}

    splits = builtin.make_arith_splits(seed=0, n_train=3000, n_val=256, n_sft=1000)
    assert len(splits["train"]) == 3000 and len(splits["val"]) == 256
    val_prompts = {r["prompt"] for r in splits["val"]}
    assert len(val_prompts) == 256  # no duplicates in val
    assert not val_prompts & {r["prompt"] for r in splits["train"]}
    assert not val_prompts & {r["prompt"] for r in splits["sft"]}
    assert all(r["response"] == r["ground_truth"] for r in splits["sft"])


def test_resolve_data_file(cache_dir, tmp_path):
    path = builtin.resolve_data_file("builtin:arith/val")
    assert path.startswith(cache_dir) and path.endswith("val.jsonl")
    rows = [json.loads(line) for line in open(path)]
    assert len(rows) == 256
    train = builtin.resolve_data_file("builtin:arith/train")
    assert sum(1 for _ in open(train)) == 20000
    assert not {r["prompt"] for r in rows} & {json.loads(l)["prompt"] for l in open(train)}
    with pytest.raises(ValueError, match="builtin:arith/train"):
        builtin.resolve_data_file("builtin:arith/test")
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        builtin.resolve_data_file(str(tmp_path / "missing.jsonl"))
    small = builtin.write_builtin_task("arith", str(tmp_path / "t"), n_train=10, n_val=5, n_sft=3)
    assert sum(1 for _ in open(os.path.join(small, "train.jsonl"))) == 10


# ------------------------------------------------------------------------------ data
def _write_jsonl(path, rows):
    with open(path, "w") as fh:
        for r in rows:
            fh.write(json.dumps(r) + "\n")
    return str(path)


def test_load_prompts_builtin(tokenizer):
    items, stats = data.load_prompts(["builtin:arith/val"], default_domain="other",
                                     tokenizer=tokenizer, max_prompt_length=32)
    assert len(items) == 256 and stats["prompts"] == 256 and stats["filtered_prompts"] == 0
    it = items[0]
    assert set(it) == {"prompt_text", "prompt_ids", "ground_truth", "domain"}
    assert it["domain"] == "math_rule" and tokenizer.decode(it["prompt_ids"]) == it["prompt_text"]
    few, _ = data.load_prompts(["builtin:arith/val"], default_domain="x", tokenizer=tokenizer,
                               max_prompt_length=32, max_samples=10)
    assert few == items[:10]


def test_load_prompts_user_files(tokenizer, tmp_path):
    import pandas as pd

    rows = [{"prompt": "1+1=", "ground_truth": 2},
            {"messages": [{"role": "user", "content": "2+2="}], "ground_truth": "4",
             "domain": "chat"}]
    jl = _write_jsonl(tmp_path / "d.jsonl", rows)
    items, stats = data.load_prompts([jl], default_domain="math_rule", tokenizer=tokenizer,
                                     max_prompt_length=16)
    assert [i["prompt_text"] for i in items] == ["1+1=", "2+2="]
    assert [i["ground_truth"] for i in items] == ["2", "4"]
    assert [i["domain"] for i in items] == ["math_rule", "chat"]
    assert stats["per_domain"] == {"math_rule": 1, "chat": 1}

    pq = str(tmp_path / "d.parquet")
    pd.DataFrame({"question": ["3+4=", "5+6="], "answer": ["7", "11"]}).to_parquet(pq)
    items, _ = data.load_prompts([pq], prompt_key="question", answer_key="answer",
                                 default_domain="math_rule", tokenizer=tokenizer,
                                 max_prompt_length=16)
    assert [(i["prompt_text"], i["ground_truth"]) for i in items] == [("3+4=", "7"), ("5+6=", "11")]
    assert items[0]["prompt_ids"] == tokenizer("3+4=")["input_ids"]


def test_load_prompts_errors(tokenizer, tmp_path):
    kw = dict(default_domain="math_rule", tokenizer=tokenizer, max_prompt_length=16)
    with pytest.raises(FileNotFoundError, match="absent.jsonl"):
        data.load_prompts([str(tmp_path / "absent.jsonl")], **kw)
    no_answer = _write_jsonl(tmp_path / "na.jsonl", [{"prompt": "1+1="}])
    with pytest.raises(ValueError, match=r"na\.jsonl.*'ground_truth'"):
        data.load_prompts([no_answer], **kw)
    no_prompt = _write_jsonl(tmp_path / "np.jsonl", [{"prompt": "1+1=", "ground_truth": "2"},
                                                     {"text": "x", "ground_truth": "2"}])
    with pytest.raises(ValueError, match=r"np\.jsonl, row 1.*'prompt'.*'messages'"):
        data.load_prompts([no_prompt], **kw)
    with pytest.raises(ValueError, match="builtin:arith/val"):
        data.load_prompts(["builtin:nothing/train"], **kw)


def test_long_prompts_filtered(tokenizer, tmp_path, caplog):
    rows = [{"prompt": "1+1=", "ground_truth": "2"}, {"prompt": "1+" * 20 + "1=", "ground_truth": "21"},
            {"prompt": "9+9=", "ground_truth": "18"}]
    path = _write_jsonl(tmp_path / "long.jsonl", rows)
    with caplog.at_level("WARNING"):
        items, stats = data.load_prompts([path], default_domain="m", tokenizer=tokenizer,
                                         max_prompt_length=10)
    assert [i["ground_truth"] for i in items] == ["2", "18"]
    assert stats["filtered_prompts"] == 1 and stats["rows"] == 3
    assert "max_prompt_length" in caplog.text


def test_prompt_sampler_determinism_and_resume():
    items = [{"i": i} for i in range(10)]
    a = data.PromptSampler(items, 4, seed=7)
    b = data.PromptSampler(items, 4, seed=7)
    seq_a = [[x["i"] for x in a.next_batch()] for _ in range(6)]
    assert seq_a == [[x["i"] for x in b.next_batch()] for _ in range(6)]
    first_epoch = sum(seq_a, [])[:10]
    assert sorted(first_epoch) == list(range(10))  # every prompt once per epoch
    assert sum(seq_a, [])[10:20] != first_epoch  # reshuffled next epoch
    assert data.PromptSampler(items, 4, seed=8).next_batch() != \
        data.PromptSampler(items, 4, seed=7).next_batch()

    c = data.PromptSampler(items, 4, seed=7)
    for _ in range(3):
        next(c)
    state = json.loads(json.dumps(c.state_dict()))  # must survive a checkpoint round trip
    expected = [next(c) for _ in range(3)]
    d = data.PromptSampler(items, 4, seed=7)
    d.load_state_dict(state)
    assert [next(d) for _ in range(3)] == expected
    assert state["epoch"] == 1 and state["position"] == 2
    unshuffled = data.PromptSampler(items, 3, shuffle=False)
    assert [x["i"] for x in unshuffled.next_batch()] == [0, 1, 2]


def test_load_sft_samples(tokenizer, tmp_path):
    samples = data.load_sft_samples(["builtin:arith/sft"], tokenizer=tokenizer, max_length=16,
                                    max_samples=50)
    assert len(samples) == 50
    eos = tokenizer.eos_token_id
    for s in samples:
        ids, labels, mask = s["input_ids"], s["labels"], s["loss_mask"]
        assert len(ids) == len(labels) == len(mask) and ids[-1] == eos
        resp = [t for t, m in zip(ids, mask) if m]
        assert resp[-1] == eos and all(l == -100 for l, m in zip(labels, mask) if not m)
        assert tokenizer.decode(ids[:mask.index(1)]).endswith("=")
    rows = [{"prompt": "1+1=", "response": "2"}, {"prompt": "1+" * 20 + "1=", "response": "21"},
            {"messages": [{"role": "user", "content": "2+3="}, {"role": "assistant", "content": "5"}]}]
    out = data.load_sft_samples([_write_jsonl(tmp_path / "s.jsonl", rows)], tokenizer=tokenizer,
                                max_length=10)
    assert len(out) == 2
    assert tokenizer.decode(out[1]["input_ids"]) == "2+3=5<eos>"
    assert out[1]["loss_mask"] == [0, 0, 0, 0, 1, 1]


# ------------------------------------------------------------------------------ rewards
@pytest.mark.parametrize("response,truth,expected", [
    ("47", "47", 1.0), ("46", "47", 0.0), ("<think>hmm 12</think> 47", "47", 1.0),
    ("<think>the answer is 47", "47", 0.0), ("#$%^&*(garbage", "47", 0.0), ("", "47", 0.0),
    ("-3", "-3", 1.0), ("3", "-3", 0.0), ("The answer is -3.", "-3", 1.0), ("47<eos>", "47", 1.0),
    ("0.5", "\\frac{1}{2}", 1.0), (None, "1", 0.0), ("47", 47, 1.0),
    # the last-number fallback and the integer shortcut agree with math-verify's verify
    ("J]S!kD2", "2", 1.0), ("ab007", "7", 1.0), ("zz-4", "-4", 1.0), ("zz-4", "4", 0.0), ("q1.5", "1.5", 1.0),
    ("x12y", "13", 0.0), ("012", "12", 1.0), ("12", "\\frac{24}{2}", 1.0),
])
def test_math_verify_reward(response, truth, expected):
    assert rewards.math_verify_reward("12+35=", response, truth) == expected


def test_math_verify_reward_in_worker_thread():
    # math-verify's SIGALRM timeouts would fail off the main thread; the reward must still work.
    assert rewards.score_with_timeout(rewards.math_verify_reward, ("", "47", "47"), 5.0) == \
        (1.0, "ok", "")


def test_regex_match_reward():
    r = rewards.regex_match_reward
    assert r("", " 47 ", "47") == 1.0 and r("", "47.", "47") == 0.0
    assert r("", "Answer: 47!", "47", pattern=r"Answer:\s*(\d+)") == 1.0
    assert r("", "Answer: 46", "47", pattern=r"Answer:\s*(\d+)") == 0.0
    assert r("", "no answer", "47", pattern=r"Answer:\s*(\d+)") == 0.0
    assert r("", "x 47 y", "47", pattern=r"\d+") == 1.0


def test_load_reward_fn():
    assert rewards.load_reward_fn("roll_gspo.rewards:math_verify_reward") is rewards.math_verify_reward
    assert rewards.load_reward_fn("roll_gspo.rewards.regex_match_reward") is rewards.regex_match_reward
    with pytest.raises(ImportError, match="no_such_mod"):
        rewards.load_reward_fn("no_such_mod:fn")
    with pytest.raises(ImportError, match="roll_gspo.rewards:nope"):
        rewards.load_reward_fn("roll_gspo.rewards:nope")
    with pytest.raises(ValueError, match="roll_gspo.rewards:logger.name.*not callable"):
        rewards.load_reward_fn("roll_gspo.rewards:logger.name")
    with pytest.raises(ValueError):
        rewards.load_reward_fn("justaname")


def test_score_with_timeout():
    def raises(*a):
        raise KeyError("bad")

    def hangs(*a):
        time.sleep(30)

    assert rewards.score_with_timeout(lambda *a: 0.5, ("p", "r", "g"), 1.0) == (0.5, "ok", "")
    assert rewards.score_with_timeout(lambda *a: True, (), 1.0)[:2] == (1.0, "ok")
    score, status, msg = rewards.score_with_timeout(raises, ("p", "r", "g"), 1.0)
    assert (score, status) == (0.0, "error") and "KeyError" in msg
    t0 = time.time()
    score, status, _ = rewards.score_with_timeout(hangs, (), 0.5)
    assert (score, status) == (0.0, "timeout") and time.time() - t0 < 2.0
    for bad in (math.nan, math.inf, "1.0", None, [1.0]):
        score, status, _ = rewards.score_with_timeout(lambda *a, v=bad: v, (), 1.0)
        assert (score, status) == (0.0, "error"), bad



def test_score_many_with_timeout_goes_on_after_a_hang():
    # One child process scores the lot; a hung call is killed, the calls after it are still scored,
    # and nothing of the killed call comes back later.
    def fn(prompt, response, truth):
        if response == "hang":
            time.sleep(10)
            return 1.0
        if response == "raise":
            raise ValueError("boom")
        if response == "exit":
            raise SystemExit(3)
        return float(response == truth)

    calls = [("p", "7", "7"), ("p", "hang", "7"), ("p", "8", "7"), ("p", "raise", "7"), ("p", "exit", "7"),
             ("p", "hang", "7"), ("p", "7", "7")]
    t0 = time.time()
    outcomes = rewards.score_many_with_timeout(fn, calls, 0.3)
    assert time.time() - t0 < 10  # one hung call left running alone would take 10 s (loose: a busy CI)
    assert [o[:2] for o in outcomes] == [(1.0, "ok"), (0.0, "timeout"), (0.0, "ok"), (0.0, "error"), (0.0, "error"),
                                         (0.0, "timeout"), (1.0, "ok")]
    assert "boom" in outcomes[3][2] and "SystemExit" in outcomes[4][2]
    assert outcomes[1] == (0.0, "timeout", "reward function exceeded 0.3s (killed)")
    assert rewards.score_many_with_timeout(fn, calls[:1], None) == [(1.0, "ok", "")]
    assert rewards.score_many_with_timeout(fn, [], 1.0) == []

# ------------------------------------------------------------------------------ vLLM
VLLM_SCRIPT = textwrap.dedent("""
    import json, sys, time
    t0 = time.time()
    from vllm import LLM, SamplingParams
    llm = LLM(model=sys.argv[1], enforce_eager=True, dtype="float32", max_model_len=128, seed=0)
    t1 = time.time()
    outs = llm.generate(["12+35=", "7*8="], SamplingParams(max_tokens=8, logprobs=0, seed=0))
    t2 = time.time()
    res = [{"ids": list(o.outputs[0].token_ids), "text": o.outputs[0].text,
            "n_logprobs": len(o.outputs[0].logprobs or [])} for o in outs]
    print("RESULT " + json.dumps({"load_s": t1 - t0, "generate_s": t2 - t1, "outs": res}))
""")


def test_base_model_loads_in_vllm(base_model, tmp_path):
    # In-process engine, no torch.compile, 1 GiB KV cache: what keeps this test quick and small.
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", TORCH_COMPILE_DISABLE="1",
               VLLM_CPU_KVCACHE_SPACE="1", VLLM_CACHE_ROOT=str(tmp_path / "vllm_cache"))
    proc = subprocess.run([sys.executable, "-c", VLLM_SCRIPT, base_model], env=env,
                          capture_output=True, text=True, timeout=240)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    result = json.loads(lines[-1][len("RESULT "):])
    print(f"vLLM load {result['load_s']:.1f}s, generate {result['generate_s']:.2f}s")
    assert len(result["outs"]) == 2
    for out in result["outs"]:
        assert 1 <= len(out["ids"]) <= 8 and out["n_logprobs"] == len(out["ids"])


def test_the_driver_builds_a_reward_domains_built_in_model(tmp_path, monkeypatch):
    """A judge or reward model named `builtin:` is built by the driver (prepare_models) like the policy's:
    a warm-started built-in's builder is registered in the driver's process (pipelines.warm_start), and
    a reward worker's process has none. A rule reward's model name is left alone."""
    from pipelines.common import prepare_models
    from roll_gspo.schema.config import PipelineConfig, RewardConfig
    from roll_gspo.schema.frozen import freeze

    def builder(folder):
        with open(os.path.join(folder, "marker"), "w") as fh:
            fh.write("ok")

    monkeypatch.setenv(builtin.CACHE_ENV, str(tmp_path))
    builtin.register_builtin_model("builtin:test-judge", builder)
    try:
        judge = RewardConfig(worker_cls="roll_gspo.workers.rewards.LLMJudgeRewardWorker")
        judge.model_args.model_name_or_path = "builtin:test-judge"
        rule = RewardConfig(worker_cls="roll_gspo.workers.rewards.MathRuleRewardWorker")
        rule.model_args.model_name_or_path = "builtin:test-judge"
        cfg = freeze(PipelineConfig(rewards={"judge": judge, "math": rule}))
        prepared = prepare_models(cfg, [])
        folder = prepared.rewards["judge"].model_args.model_name_or_path
        assert os.path.isfile(os.path.join(folder, "marker"))
        assert prepared.rewards["math"].model_args.model_name_or_path == "builtin:test-judge"
        assert cfg.rewards["judge"].model_args.model_name_or_path == "builtin:test-judge"  # cfg read-only
    finally:
        builtin.BUILTIN_MODELS.pop("builtin:test-judge")
