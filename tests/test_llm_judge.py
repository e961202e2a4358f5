"""LLM-as-judge: strict verdict parsing, the endpoint client's retries and failures, a real
vLLM OpenAI-compatible server (started once for this module) and a judge loaded in the worker."""
import logging
import os
import socket
import subprocess
import sys
import time

import pytest

from roll_gspo.rewards.judge import JudgeError, OpenAIJudgeClient, parse_verdict, resolve_api_key
from tests.test_reward_workers import batch_of, make_worker

SECRET = "sk-test-Zq81-never-log-me"
CHOICES = ["VERDICT: CORRECT", "VERDICT: INCORRECT"]


@pytest.mark.parametrize("text,score", [
    ("The answer matches.\nVERDICT: CORRECT", 1.0), ("verdict: incorrect", 0.0), ("**VERDICT: CORRECT**", 1.0),
    ("  Verdict :  Correct.  ", 1.0), ("SCORE: 7", 0.7), ("Score: 10/10", 1.0), ("SCORE: 0", 0.0),
    ("VERDICT: INCORRECT\n...on reflection\nVERDICT: CORRECT", None),   # contradicting verdicts
    ("The answer is correct.", None), ("VERDICT: CORRECT because x", None), ("SCORE: 11", None),
    ("", None), (None, None), ("VERDICT: maybe", None),
    # the bare word ROLL's named RLVR prompt asks for; ROLL's substring test would score the last two
    ("YES", 1.0), (" no.\n", 0.0), ("**Yes**", 1.0), ("yes or no", None), ("My eyes hurt", None),
])
def test_parse_verdict(text, score):
    assert parse_verdict(text) == score


def test_roll_named_judge_prompt_is_a_template_here():
    from roll_gspo.rewards.judge import format_judge_prompt

    text = format_judge_prompt("Qwen2.5-7B-Instruct-RLVR-prompt", "2+2=", "4", "4")
    assert "2+2=" in text and "single word YES or NO" in text and "{" not in text
    assert format_judge_prompt("Q {question} R {response} T {reference}", "q", "r", "t") == "Q q R r T t"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_refused_connection_is_retried_then_an_error():
    client = OpenAIJudgeClient(f"http://127.0.0.1:{free_port()}/v1", "m", timeout_s=1, max_retries=2, backoff_s=0.05)
    start = time.monotonic()
    with pytest.raises(JudgeError) as info:
        client.complete("q")
    assert info.value.status == "error" and "unreachable" in str(info.value)
    assert client.retries == 2 and time.monotonic() - start >= 0.05 + 0.1


def test_silent_endpoint_times_out():
    with socket.socket() as server:  # accepts connections (kernel backlog) and never answers
        server.bind(("127.0.0.1", 0))
        server.listen(8)
        client = OpenAIJudgeClient(f"http://127.0.0.1:{server.getsockname()[1]}/v1", "m", timeout_s=0.3,
                                   max_retries=1, backoff_s=0.01)
        with pytest.raises(JudgeError) as info:
            client.complete("q")
    assert info.value.status == "timeout" and client.retries == 1


def test_api_key_from_env(monkeypatch):
    monkeypatch.setenv("JUDGE_KEY_FOR_TEST", SECRET)
    assert resolve_api_key("env:JUDGE_KEY_FOR_TEST") == SECRET and resolve_api_key("plain") == "plain"
    with pytest.raises(ValueError, match="NOT_SET_ANYWHERE"):
        resolve_api_key("env:NOT_SET_ANYWHERE")


def test_key_is_masked_in_printed_config_and_repr():
    from roll_gspo.config.load.loader import config_to_yaml
    from roll_gspo.schema.config import PipelineConfig, RewardConfig

    cfg = PipelineConfig(rewards={"judge": RewardConfig(judge_api_key=SECRET), "env": RewardConfig(judge_api_key="env:K")})
    text = config_to_yaml(cfg)
    assert SECRET not in text and "judge_api_key: '***'" in text and "env:K" in text
    assert SECRET not in repr(cfg)


# ------------------------------------------------------------------ a real vLLM server
@pytest.fixture(scope="module")
def vllm_server(tiny_model, tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("vllm_server") / "server.log"
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", TORCH_COMPILE_DISABLE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0",
               VLLM_CACHE_ROOT=str(log.parent / "cache"))
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", tiny_model,
                                 "--served-model-name", "judge", "--host", "127.0.0.1", "--port", str(port),
                                 "--enforce-eager", "--dtype", "float32", "--max-model-len", "256",
                                 "--api-key", SECRET], env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    import httpx

    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    try:
        while True:
            if proc.poll() is not None:
                pytest.fail(f"vLLM server exited {proc.returncode}:\n{log.read_text()[-3000:]}")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"vLLM server not up in 300 s:\n{log.read_text()[-3000:]}")
            time.sleep(1)
        yield url + "/v1"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
        proc.wait(30)


def judge_worker(url, **changes):
    from roll_gspo.workers.rewards import LLMJudgeRewardWorker

    cfg = dict(judge_model_type="api", judge_api_url=url, judge_model_name="judge", judge_api_key=SECRET,
               timeout_s=60, judge_max_retries=1,
               judge_prompt="Q: {question} R: {response} REF: {reference}\n",
               generating_args={"temperature": 0.0, "max_new_tokens": 24},  # one token per character
               reward_kwargs={"request_extra": {"structured_outputs": {"choice": CHOICES}}})
    cfg.update(changes)
    from roll_gspo.schema.config import GeneratingArgs

    cfg["generating_args"] = GeneratingArgs(**cfg["generating_args"])
    return make_worker(LLMJudgeRewardWorker, **cfg)


def test_endpoint_verdicts_from_a_real_server(vllm_server, caplog):
    records = []  # roll_gspo's loggers do not propagate to pytest's caplog
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logging.getLogger("roll_gspo").addHandler(handler)
    worker = judge_worker(vllm_server)
    with caplog.at_level(logging.DEBUG):
        out = worker.compute_scores(batch_of(["1+1=", "2+2="], ["2", "5"], ["2", "4"]))
    # The tiny judge is untrained, but constrained to the two verdict lines it always gives a
    # parsable one.
    assert out["reward_status"] == ["ok", "ok"], caplog.text[-2000:]
    assert set(out["scores"].tolist()) <= {0.0, 1.0}
    free = judge_worker(vllm_server, reward_kwargs={}, generating_args={"temperature": 0.0, "max_new_tokens": 6})
    with caplog.at_level(logging.DEBUG):
        out = free.compute_scores(batch_of(["1+1="], ["2"], ["2"]))
    assert out["reward_status"] == ["error"] and out["scores"].tolist() == [0.0]  # unparsable, counted
    # Cut at its budget (finish_reason: length): said in the message, and a batch mostly cut warns.
    logged = "\n".join(records)
    assert "judge verdict cut at max_new_tokens = 6 (raise rewards.d.generating_args.max_new_tokens)" in logged
    assert "1 of 1 verdicts were cut at max_new_tokens = 6" in logged
    logging.getLogger("roll_gspo").removeHandler(handler)
    assert SECRET not in caplog.text
    worker.close()
    free.close()


def test_judge_budget_fits_the_default_prompt():
    """The default prompt asks the judge to think before its verdict line: the budget left unset
    is 512 tokens (64 cut most verdicts off, scored 0 as errors)."""
    from roll_gspo.schema.config import GeneratingArgs
    from roll_gspo.rewards.judge import DEFAULT_JUDGE_MAX_NEW_TOKENS
    from roll_gspo.workers.rewards import LLMJudgeRewardWorker

    worker = make_worker(LLMJudgeRewardWorker, judge_model_type="api", judge_api_url=f"http://127.0.0.1:{free_port()}/v1",
                         generating_args=GeneratingArgs(temperature=0.0))
    assert worker.client.body["max_tokens"] == DEFAULT_JUDGE_MAX_NEW_TOKENS == 512
    worker.close()
    from roll_gspo.schema.config import RewardConfig

    assert RewardConfig().generating_args.max_new_tokens == 512  # what a YAML without the key gets


def test_wrong_key_and_dead_endpoint_score_zero_and_never_log_the_key(vllm_server, caplog, capfd):
    wrong = judge_worker(vllm_server, judge_api_key=SECRET + "-wrong")
    dead = judge_worker(f"http://127.0.0.1:{free_port()}/v1", timeout_s=2)
    with caplog.at_level(logging.DEBUG):
        out_wrong = wrong.compute_scores(batch_of(["q"], ["r"], ["t"]))
        out_dead = dead.compute_scores(batch_of(["q"], ["r"], ["t"]))
    assert out_wrong["reward_status"] == ["error"] and "401" in caplog.text
    assert out_dead["reward_status"] == ["error"] and out_dead["scores"].tolist() == [0.0]
    captured = capfd.readouterr()
    assert SECRET not in caplog.text + captured.out + captured.err
    wrong.close()
    dead.close()


def test_judge_loaded_in_the_worker(tiny_model):
    from roll_gspo.schema.config import GeneratingArgs, ModelArgs, StrategyArgs
    from roll_gspo.workers.rewards import LLMJudgeRewardWorker

    worker = make_worker(LLMJudgeRewardWorker, judge_model_type="inference", model_args=ModelArgs(model_name_or_path=tiny_model),
                         strategy_args=StrategyArgs(strategy_name="hf_infer"), infer_batch_size=2,
                         generating_args=GeneratingArgs(temperature=0.0, max_new_tokens=4),
                         judge_prompt="{question}{response}")
    out = worker.compute_scores(batch_of(["1+1=", "2+2=", "3+3="], ["2", "4", "6"], ["2", "4", "6"]))
    # An untrained judge writes no verdict line: every response is scored 0 and counted.
    assert out["reward_status"] == ["error"] * 3 and out["scores"].tolist() == [0.0] * 3
    texts = [worker.tokenizer.decode(s[0][0]) for s in worker.engine.generate([[5, 6]], worker.cfg.generating_args, 1)]
    assert len(texts) == 1
    # A judge prompt longer than the judge's context is that response's counted error, not a crash.
    out = worker.compute_scores(batch_of(["1+1=" * 80, "2+2="], ["2", "4"], ["2", "4"]))
    records = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logging.getLogger("roll_gspo").addHandler(handler)
    try:
        out = worker.compute_scores(batch_of(["1+1=" * 80], ["2"], ["2"]))
    finally:
        logging.getLogger("roll_gspo").removeHandler(handler)
    assert out["reward_status"] == ["error"]
    assert any("exceeds the judge's 256-token context" in message for message in records)
