"""vLLM (in-process, CPU MoE backend) takes a trainer's MoE weights: after each of two updates
its log-probs equal transformers' and every expert's packed weights equal what vLLM packs from
the new weights itself, in both update modes. Before the fix, vLLM kept the unpacked weights
in its packed tensors after any update (gap ~1e-1 here)."""
import os

import pytest
import torch

pytestmark = pytest.mark.e2e

SEQUENCES = [[20, 21, 15, 22, 23, 24, 1], [25, 15, 26, 27, 28, 29, 30], [31, 32, 15, 33, 1]]


def _expert_tensors(worker):
    """Per MoE layer: vLLM's packed w13/w2 and the same weights packed by its own kernel code."""
    from roll_gspo.sync.vllm_moe import cpu_moe_layers

    return {name: (layer.w13_weight.detach().clone(), layer.w2_weight.detach().clone(),
                   layer.quant_method.moe_kernel.fused_experts.isa)
            for name, layer in cpu_moe_layers(worker.get_model())}


@pytest.fixture(scope="module")
def qwen2_moe_model(tmp_path_factory):
    """A micro Qwen2-MoE: routed experts plus a shared expert with its sigmoid gate."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    from roll_gspo.builtin.tokenizer import build_tokenizer

    folder = str(tmp_path_factory.mktemp("qwen2_moe"))
    tokenizer = build_tokenizer()
    config = Qwen2MoeConfig(vocab_size=len(tokenizer), hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, intermediate_size=256, moe_intermediate_size=32,
                            shared_expert_intermediate_size=64, num_experts=4, num_experts_per_tok=2,
                            max_position_embeddings=256, tie_word_embeddings=True, bos_token_id=None,
                            eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    Qwen2MoeForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.mark.parametrize("arch, mode", [("qwen3_moe", "auto"), ("qwen3_moe", "layerwise"), ("qwen2_moe", "auto")])
def test_vllm_moe_weight_updates_match_trainer_for_every_expert(request, arch, mode):
    model_dir = request.getfixturevalue("tiny_moe_model" if arch == "qwen3_moe" else "qwen2_moe_model")
    from transformers import AutoModelForCausalLM
    from vllm import LLM, SamplingParams
    from vllm._custom_ops import cpu_prepack_moe_weight

    from roll_gspo.strategies.vllm_strategy import EXTENSION

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    llm = LLM(model=model_dir, dtype="float32", max_model_len=32, enforce_eager=True, seed=0,
              worker_extension_cls=EXTENSION)
    try:
        used = llm.collective_rpc("roll_gspo_prepare_weight_updates", args=(mode,))[0]
        assert used == ("direct" if mode == "auto" else "layerwise")

        def vllm_log_probs():
            outs = llm.generate([{"prompt_token_ids": s} for s in SEQUENCES],
                                SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
            return [torch.tensor([o.prompt_logprobs[i][t].logprob for i, t in enumerate(s) if i])
                    for o, s in zip(outs, SEQUENCES)]

        @torch.no_grad()
        def trainer_log_probs():
            rows = []
            for s in SEQUENCES:
                ids = torch.tensor([s])
                log_softmax = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1)
                rows.append(log_softmax.gather(1, ids[0, 1:, None])[:, 0])
            return rows

        def gap():
            return max(float((v - t).abs().max()) for v, t in zip(vllm_log_probs(), trainer_log_probs()))

        assert gap() < 1e-4
        generator = torch.Generator().manual_seed(1)
        for update in range(2):
            with torch.no_grad():  # a trainer step's worth of change, everywhere
                for param in model.parameters():
                    param.add_(0.02 * torch.randn(param.shape, generator=generator))
                # one expert of one layer changes much more: it must arrive too
                model.model.layers[1].mlp.experts.gate_up_proj[3].add_(0.5)
            # the trainer's names (transformers' fused experts), as the weight sync sends them
            named = [(n, p.detach().clone()) for n, p in model.named_parameters(remove_duplicate=False)]
            llm.collective_rpc("roll_gspo_begin_weight_update")
            llm.collective_rpc("roll_gspo_load_weights", args=(named[: len(named) // 2],))  # two buckets
            llm.collective_rpc("roll_gspo_load_weights", args=(named[len(named) // 2:],))
            llm.collective_rpc("roll_gspo_finish_weight_update")
            llm.reset_prefix_cache()
            assert gap() < 1e-4, f"update {update}"
            packed = llm.collective_rpc(_expert_tensors)[0]
            assert len(packed) == model.config.num_hidden_layers
            for index, layer in enumerate(model.model.layers):
                w13, w2, isa = packed[f"model.layers.{index}.mlp.experts.routed_experts"]
                experts = layer.mlp.experts
                for expert in range(model.config.num_experts):  # a stale expert fails here by name
                    want13 = cpu_prepack_moe_weight(experts.gate_up_proj[expert:expert + 1].detach().contiguous(), isa)
                    want2 = cpu_prepack_moe_weight(experts.down_proj[expert:expert + 1].detach().contiguous(), isa)
                    assert torch.equal(w13[expert:expert + 1], want13), (index, expert, "w13")
                    assert torch.equal(w2[expert:expert + 1], want2), (index, expert, "w2")
    finally:
        del llm
