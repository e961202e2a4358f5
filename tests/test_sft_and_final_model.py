"""The SFT pipeline through the CLI, and the saved final model reloading in transformers and vLLM."""
import json

import pytest

from tests.conftest import REPO_ROOT

pytestmark = pytest.mark.e2e


def test_sft_pipeline_trains_and_its_model_reloads(tmp_path, tiny_model, session_cache, ray_session, monkeypatch):
    """`run_pipeline.py --config sft_tiny_arith.yaml ...` as `roll_gspo.cli.main` in this process on
    the session's Ray (the SFT pipeline leaves a Ray it did not start running): the command
    line's path without a fresh interpreter and a private Ray starting and stopping."""
    from roll_gspo.cli import main

    output_dir = tmp_path / "sft"
    monkeypatch.chdir(REPO_ROOT)
    assert main(["--config", "sft_tiny_arith.yaml", f"output_dir={output_dir}",
                 f"pretrain={tiny_model}", "actor_train.data_args.max_samples=512",
                 "actor_train.training_args.num_train_epochs=2", "actor_train.training_args.per_device_train_batch_size=16",
                 "actor_train.world_size=2", "actor_train.num_cpus_per_worker=0.5", "track_with=none"]) == 0
    assert ray_session.is_initialized()  # the session's Ray is still there for the next test
    with open(output_dir / "metrics.jsonl") as handle:
        losses = [json.loads(line)["sft/loss"] for line in handle]
    assert losses[-1] < losses[0] - 0.5  # a random model's loss falls fast on this data

    final = str(output_dir / "final_model")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(final)
    tokenizer = AutoTokenizer.from_pretrained(final)
    assert model.config.tie_word_embeddings and tokenizer.eos_token == "<eos>"
    # vLLM loads it and generates (in this process, as tests/test_moe_vllm_sync.py runs its engines:
    # the suite has imported vLLM by now; a fresh interpreter would import it again).
    from vllm import LLM, SamplingParams

    llm = LLM(model=final, enforce_eager=True, dtype="float32", max_model_len=32)
    try:
        out = llm.generate([{"prompt_token_ids": [20, 21, 15]}], SamplingParams(max_tokens=4, temperature=0),
                           use_tqdm=False)
        assert 1 <= len(out[0].outputs[0].token_ids) <= 4
    finally:
        del llm
