"""Peak memory of the log-prob pass for a 152k-vocabulary model, before and after issue 9 item 16.

    .venv/bin/python benchmarks/bench_logprob_memory.py                      # batch 1, 256 + 1024 tokens
    .venv/bin/python benchmarks/bench_logprob_memory.py --prompt-len 1024 --response-len 4096 --only after

A tiny random Qwen2 (hidden 64, 2 layers, vocabulary 151936 like Qwen2.5; built locally, nothing
downloaded) scores one batch of prompt + response tokens two ways:

* ``before``: the log-prob code as it was (kept below, verbatim in substance): full ``(B, L, V)``
  logits, upcast and divided by the temperature, gathered to the response span, ``log_softmax``,
  and its ``exp`` for the entropy;
* ``after``: ``roll_gspo.models.causal_lm.response_token_log_probs`` (logits from the first response
  position only, chunked log-softmax, chunked gradient).

Two passes each: ``scoring`` (no grad, no entropy: old log-probs and the reference) and ``train``
(grad, entropy as a metric, backward of a masked mean). Every measurement runs in a fresh process
and reports the peak resident memory during the pass minus the memory just before it (Linux
``VmHWM`` after a reset through ``/proc/self/clear_refs``), so the model's own weights are not
counted. The vocabulary dominates: the model's few MB of activations are noise at these sizes.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from typing import Dict, List, Optional

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QWEN_VOCAB = 151936
PASSES = ("scoring", "train")


def logprob_before(model, input_ids, attention_mask, prompt_lengths, response_len, temperature=1.0,
                   with_entropy=False):
    """The log-prob computation before item 16 (roll_gspo/models/causal_lm.py at commit 132d747)."""
    import torch

    logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
    logits = logits[:, :-1].float()
    if temperature not in (0.0, 1.0):
        logits = logits / temperature
    next_tokens = input_ids[:, 1:]
    offsets = torch.arange(response_len, device=input_ids.device)
    index = (prompt_lengths.to(input_ids.device)[:, None] - 1 + offsets[None, :]).clamp(max=logits.shape[1] - 1)
    picked_logits = torch.gather(logits, 1, index[:, :, None].expand(-1, -1, logits.shape[-1]))
    log_softmax = torch.log_softmax(picked_logits, dim=-1)
    targets = torch.gather(next_tokens, 1, index)
    log_probs = torch.gather(log_softmax, 2, targets[:, :, None]).squeeze(-1)
    entropy = None
    if with_entropy:
        with torch.no_grad():
            entropy = -(log_softmax.exp() * log_softmax).sum(-1)
    return log_probs, entropy


def _rss_kb(field: str) -> int:
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as handle:
        handle.write("5")  # resets VmHWM to the current RSS


def measure_in_this_process(impl: str, pass_name: str, args) -> Dict[str, float]:
    """Build the model and batch, run one pass, return its peak extra memory in MB."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    sys.path.insert(0, REPO)
    from roll_gspo.models.causal_lm import build_sequences, response_token_log_probs

    torch.manual_seed(0)
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    length = args.prompt_len + args.response_len
    config = Qwen2Config(vocab_size=args.vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=length + 8,
                         tie_word_embeddings=True)
    model = Qwen2ForCausalLM(config).float()
    generator = torch.Generator().manual_seed(1)
    prompts = torch.randint(1, args.vocab, (args.batch, args.prompt_len), generator=generator).tolist()
    responses = torch.randint(1, args.vocab, (args.batch, args.response_len), generator=generator).tolist()
    input_ids, attention, prompt_lengths, response_mask = build_sequences(prompts, responses, 0)
    fn = logprob_before if impl == "before" else response_token_log_probs
    width = response_mask.shape[1]
    _reset_peak()
    before_kb = _rss_kb("VmRSS")
    if pass_name == "scoring":
        model.eval()
        with torch.no_grad():
            log_probs, _ = fn(model, input_ids, attention, prompt_lengths, width, args.temperature, False)
    else:
        model.train()
        log_probs, entropy = fn(model, input_ids, attention, prompt_lengths, width, args.temperature, True)
        loss = -(log_probs * response_mask).sum() / response_mask.sum()
        loss.backward()
        float(entropy.mean())
    checksum = float(log_probs.detach().double().sum())
    peak_kb = _rss_kb("VmHWM")
    return {"peak_mb": (peak_kb - before_kb) / 1024, "checksum": checksum}


def measure(impl: str, pass_name: str, args) -> Dict[str, float]:
    """`measure_in_this_process` in a fresh interpreter (peaks do not leak between runs)."""
    return finish(impl, pass_name, start(impl, pass_name, args))


def start(impl: str, pass_name: str, args) -> subprocess.Popen:
    """The fresh interpreter of one measurement, started (`finish` collects its figures)."""
    command = [sys.executable, os.path.abspath(__file__), "--child", impl, pass_name,
               "--batch", str(args.batch), "--prompt-len", str(args.prompt_len),
               "--response-len", str(args.response_len), "--vocab", str(args.vocab),
               "--temperature", str(args.temperature)]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)


def finish(impl: str, pass_name: str, proc: subprocess.Popen) -> Dict[str, float]:
    stdout, stderr = proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"{impl} {pass_name} failed (exit {proc.returncode}):\n{stderr[-3000:]}")
    return json.loads(stdout.strip().splitlines()[-1])


def run(args) -> Dict[str, Dict[str, Optional[Dict[str, float]]]]:
    impls = ["before", "after"] if args.only is None else [args.only]
    if not getattr(args, "parallel", False):
        return {p: {impl: (measure(impl, p, args) if impl in impls else None) for impl in ("before", "after")}
                for p in args.passes}
    # Every measurement's process at once: each reports its own process's peak (VmHWM), which the
    # others do not change; only the machine must hold all of them together.
    procs = {(p, impl): start(impl, p, args) for p in args.passes for impl in impls}
    return {p: {impl: (finish(impl, p, procs[p, impl]) if impl in impls else None) for impl in ("before", "after")}
            for p in args.passes}


def format_table(results, args) -> str:
    length = args.prompt_len + args.response_len
    one_copy = args.batch * length * args.vocab * 4 / 2 ** 20
    lines = [f"log-prob pass, peak memory above the model's (MB): vocabulary {args.vocab}, batch {args.batch}, "
             f"prompt {args.prompt_len} + response {args.response_len} tokens, temperature {args.temperature:g}; "
             f"one fp32 (B, L, V) logits tensor is {one_copy:.0f} MB",
             f"{'pass':<34}{'before':>10}{'after':>10}{'after/before':>14}"]
    labels = {"scoring": "scoring (no grad: old log-probs, ref)", "train": "train (forward+backward+entropy)"}
    for name in results:
        before, after = results[name]["before"], results[name]["after"]
        b = f"{before['peak_mb']:.0f}" if before else "-"
        a = f"{after['peak_mb']:.0f}" if after else "-"
        ratio = f"{after['peak_mb'] / before['peak_mb']:.2f}" if before and after and before["peak_mb"] > 0 else "-"
        lines.append(f"{labels[name]:<34}{b:>10}{a:>10}{ratio:>14}")
    return "\n".join(lines)


def parse_args(argv: Optional[List[str]] = None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--response-len", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=QWEN_VOCAB)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--only", choices=["before", "after"], help="measure one side (the other may not fit)")
    parser.add_argument("--passes", nargs="+", choices=PASSES, default=list(PASSES))
    parser.add_argument("--json", help="also write the figures to this file")
    parser.add_argument("--parallel", action="store_true",
                        help="run every measurement's process at once (peaks are per process; needs the memory of "
                             "all of them together)")
    parser.add_argument("--child", nargs=2, metavar=("IMPL", "PASS"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if min(args.batch, args.prompt_len, args.response_len, args.vocab) < 1:
        parser.error("sizes must be >= 1")
    return args


def main(argv: Optional[List[str]] = None) -> None:
    args = parse_args(argv)
    if args.child:
        print(json.dumps(measure_in_this_process(args.child[0], args.child[1], args)))
        return
    results = run(args)
    print(format_table(results, args))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"args": vars(args), "results": results}, handle, indent=2)


if __name__ == "__main__":
    main()
