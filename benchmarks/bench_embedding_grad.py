"""A tied embedding's gradient, dense against sparse: one training micro-batch's forward and backward.

The trainer lets an input embedding tied to the LM head send a sparse gradient
(``roll_gspo.models.causal_lm.sparse_tied_embedding_grad``): the parameter's gradient is the same
dense tensor, but the embedding's own vocabulary x hidden gradient is no longer zero-filled and
added on every backward pass. This benchmark times both ways on one model, interleaved round by
round (so drift in the machine's load hits both alike), through the trainer's own log-prob
function, and checks that the gradients agree.

    .venv/bin/python benchmarks/bench_embedding_grad.py                       # Qwen2.5-0.5B shape, 152k vocabulary
    .venv/bin/python benchmarks/bench_embedding_grad.py --model builtin:smollm2-135m-instruct --rounds 5
    .venv/bin/python benchmarks/bench_embedding_grad.py --model builtin:tiny-arith-base --rounds 2   # seconds

Random token ids (up to the vocabulary), a micro-batch of ``--batch`` rows x (``--prompt`` +
``--response``) tokens, the response scored; fp32, ``--threads`` torch threads. Prints the median
forward and backward per way, the backward ratio, and the largest gradient difference (a
repeated token's rows are added in another order: ~1e-7 relative, exactly 0 without repeats).
Exits 1 if the gradients differ beyond that or the model does not tie its embedding.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Dict, List, Tuple

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

import torch  # noqa: E402

from roll_gspo.models.causal_lm import load_causal_lm, response_token_log_probs, sparse_tied_embedding_grad  # noqa: E402

WAYS = ("dense", "sparse")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="builtin:qwen2.5-0.5b-shape", help="a builtin: name or an HF folder")
    parser.add_argument("--batch", type=int, default=2, help="rows of the micro-batch")
    parser.add_argument("--prompt", type=int, default=16, help="prompt tokens a row")
    parser.add_argument("--response", type=int, default=128, help="response tokens a row (scored)")
    parser.add_argument("--rounds", type=int, default=4, help="measured rounds, each way once a round")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def one_pass(model, ids: torch.Tensor, prompt: int) -> Tuple[float, float]:
    """(forward s, backward s) of one micro-batch, its gradients left in the parameters."""
    model.zero_grad(set_to_none=True)
    start = time.perf_counter()
    lengths = torch.full((ids.shape[0],), prompt, dtype=torch.long)
    log_probs, _ = response_token_log_probs(model, ids, torch.ones_like(ids), lengths, ids.shape[1] - prompt)
    loss = -log_probs.mean()
    middle = time.perf_counter()
    loss.backward()
    return middle - start, time.perf_counter() - middle


def run(args: argparse.Namespace) -> int:
    from roll_gspo.builtin.models import resolve_model

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    folder = resolve_model(args.model)
    model = load_causal_lm(folder, "fp32").train()
    embedding = model.get_input_embeddings()
    if not sparse_tied_embedding_grad(model):
        print(f"{args.model}: its input embedding is not tied to a trained LM head; nothing to compare")
        return 1
    vocab = embedding.weight.shape[0]
    ids = torch.randint(0, vocab, (args.batch, args.prompt + args.response))

    grads: Dict[str, torch.Tensor] = {}
    for way in WAYS:  # a warm-up pass each, whose gradients are compared
        embedding.sparse = way == "sparse"
        one_pass(model, ids, args.prompt)
        grads[way] = embedding.weight.grad.clone()
    difference = float((grads["dense"] - grads["sparse"]).abs().max())
    scale = float(grads["dense"].abs().max()) or 1.0

    times: Dict[str, List[Tuple[float, float]]] = {way: [] for way in WAYS}
    for _ in range(args.rounds):
        for way in WAYS:
            embedding.sparse = way == "sparse"
            times[way].append(one_pass(model, ids, args.prompt))

    params = sum(p.numel() for p in model.parameters())
    print(f"{args.model}: {params / 1e6:.1f}M parameters, vocabulary {vocab} x hidden {embedding.weight.shape[1]}, "
          f"micro-batch {args.batch} x ({args.prompt} + {args.response}) tokens, fp32, {args.threads} threads, "
          f"medians of {args.rounds} interleaved rounds after a warm-up each")
    print(f"{'embedding gradient':<20}{'forward s':>11}{'backward s':>12}   backward each round")
    medians = {}
    for way in WAYS:
        forward = statistics.median(t[0] for t in times[way])
        medians[way] = statistics.median(t[1] for t in times[way])
        print(f"{way:<20}{forward:>11.3f}{medians[way]:>12.3f}   {', '.join(f'{t[1]:.2f}' for t in times[way])}")
    print(f"backward sparse / dense: {medians['sparse'] / medians['dense']:.2f}; "
          f"largest gradient difference {difference:.2e} (largest gradient value {scale:.2e})")
    return 0 if difference <= 1e-5 * scale else 1


if __name__ == "__main__":
    sys.exit(run(parse_args()))
