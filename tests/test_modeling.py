import pytest
import torch

from roll_gspo.models.causal_lm import build_sequences, pad_2d


def test_build_sequences_lays_out_right_padded_rows():
    prompts, responses = [[5, 6, 7], [8]], [[9, 1], []]
    input_ids, attention, prompt_lengths, response_mask = build_sequences(prompts, responses, pad_token_id=0)
    assert input_ids.tolist() == [[5, 6, 7, 9, 1], [8, 0, 0, 0, 0]]
    assert attention.tolist() == [[1, 1, 1, 1, 1], [1, 0, 0, 0, 0]]
    assert prompt_lengths.tolist() == [3, 1]
    assert response_mask.tolist() == [[1.0, 1.0], [0.0, 0.0]] and response_mask.dtype == torch.float32
    assert input_ids.dtype == attention.dtype == torch.long


def test_pad_2d_truncates_to_width_and_handles_empty():
    assert pad_2d([[1, 2, 3], [4]], pad_value=-1, width=2).tolist() == [[1, 2], [4, -1]]
    assert pad_2d([]).shape == (0, 0)


# --------------------------------------------------------------------------------------------
# Log-probs of sampled tokens in bounded memory: equal to the straightforward
# computation, in value and gradient.
# --------------------------------------------------------------------------------------------
def reference_log_probs(model, input_ids, attention_mask, prompt_lengths, response_len, temperature, with_entropy):
    """The straightforward implementation (full fp32 logits, gather, log_softmax)."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits[:, :-1].float()
    logits = logits / temperature
    index = (prompt_lengths[:, None] - 1 + torch.arange(response_len)[None, :]).clamp(max=logits.shape[1] - 1)
    picked = torch.gather(logits, 1, index[:, :, None].expand(-1, -1, logits.shape[-1]))
    log_softmax = torch.log_softmax(picked, dim=-1)
    log_probs = torch.gather(log_softmax, 2, torch.gather(input_ids[:, 1:], 1, index)[:, :, None]).squeeze(-1)
    entropy = -(log_softmax.exp() * log_softmax).sum(-1) if with_entropy else None
    return log_probs, entropy


def ragged_batch(vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, vocab, (n,), generator=g).tolist() for n in (5, 2, 9)]
    responses = [torch.randint(1, vocab, (n,), generator=g).tolist() for n in (7, 3, 1)]
    return build_sequences(prompts, responses, pad_token_id=0)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_log_probs_equal_the_straightforward_ones_in_value_and_gradient(tiny_model, monkeypatch, temperature):
    from transformers import AutoModelForCausalLM

    from roll_gspo.algorithms import logprobs
    from roll_gspo.models.causal_lm import response_token_log_probs

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    vocab = model.config.vocab_size
    monkeypatch.setattr(logprobs, "CHUNK_ELEMENTS", 3 * vocab)  # several chunks, one ending mid-row
    input_ids, attention, prompt_lengths, response_mask = ragged_batch(vocab)
    width = response_mask.shape[1]
    weights = torch.randn(response_mask.shape, generator=torch.Generator().manual_seed(1)) * response_mask
    results = {}
    for name, fn in (("chunked", response_token_log_probs), ("reference", reference_log_probs)):
        model.zero_grad()
        log_probs, entropy = fn(model, input_ids, attention, prompt_lengths, width, temperature, True)
        (log_probs * weights).sum().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results[name] = (log_probs.detach(), entropy, grads)
    (lp, ent, grads), (ref_lp, ref_ent, ref_grads) = results["chunked"], results["reference"]
    valid = response_mask.bool()
    assert lp.shape == ref_lp.shape == (3, 7) and lp.dtype == torch.float32
    torch.testing.assert_close(lp[valid], ref_lp[valid], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent[valid], ref_ent[valid], rtol=1e-5, atol=1e-5)
    assert not ent.requires_grad
    assert grads.keys() == ref_grads.keys() and grads
    for name in grads:
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=1e-4, atol=1e-6)
    with torch.no_grad():  # the scoring path (old log-probs, reference) gives the same numbers
        no_grad_lp, none = response_token_log_probs(model, input_ids, attention, prompt_lengths, width, temperature)
    assert none is None
    torch.testing.assert_close(no_grad_lp[valid], ref_lp[valid], rtol=1e-5, atol=1e-5)


def test_sampled_token_log_probs_gradcheck_with_repeated_positions(monkeypatch):
    from roll_gspo.algorithms import logprobs

    monkeypatch.setattr(logprobs, "CHUNK_ELEMENTS", 2 * 5)
    logits = torch.randn(2, 3, 5, dtype=torch.float64, requires_grad=True)
    rows, positions = torch.tensor([0, 0, 1, 1, 1]), torch.tensor([0, 2, 1, 1, 2])  # (1, 1) twice
    targets = torch.tensor([4, 0, 3, 1, 2])
    weights = torch.randn(5, dtype=torch.float64)
    (chunked,) = torch.autograd.grad((logprobs.sampled_token_log_probs(logits, rows, positions, targets, 0.6)[0]
                                      * weights).sum(), logits)
    direct = torch.log_softmax(logits[rows, positions].float() / 0.6, -1).gather(-1, targets[:, None]).squeeze(-1)
    (expected_grad,) = torch.autograd.grad((direct * weights).sum(), logits)
    assert chunked.dtype == torch.float64 and chunked[1, 1].abs().sum() > 0
    torch.testing.assert_close(chunked, expected_grad, rtol=1e-5, atol=1e-6)
    log_probs, entropy = logprobs.sampled_token_log_probs(logits, rows, positions, targets, 1.0, with_entropy=True)
    expected = torch.log_softmax(logits[rows, positions].float(), -1)
    torch.testing.assert_close(log_probs, expected.gather(-1, targets[:, None]).squeeze(-1))
    torch.testing.assert_close(entropy, -(expected.exp() * expected).sum(-1))


# --------------------------------------------------------------------------------------------
# A trained embedding tied to the LM head sends a sparse gradient (no vocabulary x hidden dense
# copy per backward pass): the same parameter gradient, dense, for every optimizer and
# engine; untied or frozen embeddings are left alone.
# --------------------------------------------------------------------------------------------
def test_tied_embedding_sends_a_sparse_gradient_with_the_same_dense_result(tiny_model):
    from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM

    from roll_gspo.models.causal_lm import response_token_log_probs, sparse_tied_embedding_grad

    def gradients(model):
        model.zero_grad(set_to_none=True)
        # repeated tokens: one embedding row gets several rows of gradient
        ids = torch.tensor([[3, 4, 3, 5, 3, 6], [7, 3, 3, 8, 9, 3]])
        log_probs, _ = response_token_log_probs(model, ids, torch.ones_like(ids), torch.tensor([2, 3]), 3)
        (-log_probs.sum()).backward()
        return {name: p.grad.clone() for name, p in model.named_parameters()}

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    embedding = model.get_input_embeddings()
    assert embedding.weight is model.get_output_embeddings().weight and not embedding.sparse
    dense = gradients(model)
    assert sparse_tied_embedding_grad(model) and embedding.sparse
    sparse = gradients(model)
    assert embedding.weight.grad.layout == torch.strided  # what AdamW and the engines take
    assert dense.keys() == sparse.keys()
    for name in dense:
        torch.testing.assert_close(sparse[name], dense[name], rtol=1e-6, atol=1e-7, msg=name)
    # untied: the parameter's own gradient would be sparse, so nothing changes
    config = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=False)
    untied = Qwen2ForCausalLM(config)
    assert not sparse_tied_embedding_grad(untied) and not untied.get_input_embeddings().sparse
    # frozen (a LoRA base model): no gradient to send
    frozen = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).requires_grad_(False)
    assert not sparse_tied_embedding_grad(frozen)


def test_the_trained_policy_gets_the_sparse_embedding_gradient_and_scorers_do_not(tiny_model):
    from roll_gspo.schema.config import RoleConfig
    from roll_gspo.strategies.train_engine import load_policy_model

    role = RoleConfig()
    role.model_args.model_name_or_path = tiny_model
    trained, _ = load_policy_model(role, train=True, dtype="fp32")
    scorer, _ = load_policy_model(role, train=False, dtype="fp32")
    assert trained.get_input_embeddings().sparse and not scorer.get_input_embeddings().sparse


# --------------------------------------------------------------------------------------------
# The LM head gets a contiguous input: with its weight frozen (LoRA, reference, teacher) a
# strided `logits_to_keep` slice made torch copy the vocabulary x hidden weight once per row.
# --------------------------------------------------------------------------------------------
def test_a_frozen_head_scores_from_a_contiguous_input_with_the_same_log_probs(tiny_model):
    from torch.profiler import profile

    from roll_gspo.models.causal_lm import load_causal_lm, response_token_log_probs

    ids, mask, prompt_lengths, response_mask = ragged_batch(64)
    model = load_causal_lm(tiny_model).requires_grad_(False).eval()
    seen = []
    model.get_output_embeddings().register_forward_pre_hook(lambda _, args: seen.append(args[0].is_contiguous()))

    def score():
        with torch.no_grad(), profile() as prof:
            log_probs, _ = response_token_log_probs(model, ids, mask, prompt_lengths, response_mask.shape[1])
        return log_probs, {event.key for event in prof.key_averages()}

    log_probs, ops = score()
    assert seen == [True] and "aten::bmm" not in ops  # the head is one matmul over folded rows
    model.get_output_embeddings()._forward_pre_hooks.clear()  # the straightforward strided input
    unhooked, ops = score()
    assert "aten::bmm" in ops  # what the hook avoids (torch 2.13); if this fails, torch changed
    torch.testing.assert_close(log_probs, unhooked)
