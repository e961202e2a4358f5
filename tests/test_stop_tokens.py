"""Where a response ends: every eos id of the model folder's generation_config
ends an hf_infer response, as it ends a vLLM one, and the response mask stops there.

The real model's `<|im_end|>` in vLLM and hf_infer alike, its pad/eos ids and the system turn are
tested on SmolLM2 itself in test_gguf_models.py; these use the tiny model and cost seconds."""
import json
import shutil

from roll_gspo.schema.config import GeneratingArgs, RoleConfig


def test_hf_infer_stops_at_every_eos_id_of_the_generation_config(tiny_model, tmp_path):
    """A model whose generation_config.json names a second eos id (as Qwen2.5-Instruct's does):
    greedy hf_infer ends the response at that id, counted as finished."""
    from transformers import AutoTokenizer

    from roll_gspo.strategies.hf_infer_strategy import HfInferStrategy, stop_token_ids

    folder = tmp_path / "model"
    shutil.copytree(tiny_model, folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    role = RoleConfig(infer_batch_size=4)
    role.model_args.model_name_or_path = str(folder)
    gen = GeneratingArgs(max_new_tokens=8, temperature=0.0)
    prompt = tokenizer("12+34=")["input_ids"]
    [[(free, _, _)]] = HfInferStrategy(role, seed=0).generate([prompt], gen, 1)
    # the first token of the free reply that did not occur before it becomes the second eos id
    cut = next(i for i, token in enumerate(free) if token not in free[:i] and token != tokenizer.eos_token_id)
    config_path = folder / "generation_config.json"
    config = json.loads(config_path.read_text())
    config["eos_token_id"] = [tokenizer.eos_token_id, free[cut]]
    config_path.write_text(json.dumps(config))
    assert stop_token_ids(str(folder), tokenizer) == [tokenizer.eos_token_id, free[cut]]
    [[(stopped, log_probs, finished)]] = HfInferStrategy(role, seed=0).generate([prompt], gen, 1)
    assert stopped == free[:cut + 1] and finished and len(log_probs) == cut + 1


def test_the_response_mask_ends_at_the_eos_token_and_pad_is_not_eos():
    """A finished response keeps its eos in the mask (the model learns to stop) and nothing after
    it; pad (SmolLM2: `<|endoftext|>` 0, eos `<|im_end|>` 2) fills the rest of the row."""
    from roll_gspo.models.causal_lm import build_sequences

    pad, eos = 0, 2
    ids, attention, prompt_lengths, mask = build_sequences([[1, 5, 6], [1, 5]], [[7, 8, eos], [9]], pad)
    assert mask.tolist() == [[1, 1, 1], [1, 0, 0]]
    assert ids.tolist() == [[1, 5, 6, 7, 8, eos], [1, 5, 9, pad, pad, pad]]
    assert attention.sum(-1).tolist() == [6, 3] and prompt_lengths.tolist() == [3, 2]
