#!/usr/bin/env python
"""The CUDA paths of roll_gspo that one GPU can run without vLLM or Ray (issue 23 item 11).

    python scripts/gpu_check.py            # from the repository root
    python scripts/gpu_check.py --quick    # fewer steps and rounds

One line per check, `PASS|FAIL|SKIP name: figures`, after `#` lines naming the machine:

  deepspeed_builtin   training steps of the built-in model (roll_gspo's DeepSpeedStrategy, ZeRO-2,
                      bf16, NCCL): seconds per step, peak GPU memory
  deepspeed_qwen05b   the same on a Qwen2.5-0.5B-shaped model (random weights, gradient checkpointing)
  cuda_ipc            weight sync's same-GPU hand-off between two processes (roll_gspo.sync: the
                      sender packs a bucket and shares it by CUDA IPC, a spawned receiver maps it at
                      its own device index, copies it out and unpacks it): bitwise equality, GB/s
  hf_generate_score   transformers sampling on the GPU, then the trainer's scoring pass
                      (roll_gspo.models.causal_lm.response_token_log_probs) over the sampled tokens:
                      max |log-prob gap| against the generation's own logits
  fsdp2               FSDP2 over NCCL: bf16 steps of the 0.5B-shaped model with the project's fsdp2_train

Exit status 1 if any check FAILs. Without CUDA every check SKIPs and the exit status is 0.
Needs torch; transformers and DeepSpeed where a check uses them (a check whose third-party
module is missing SKIPs, naming it).
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import socket
import statistics
import sys
import tempfile
import time
import traceback
from typing import Callable, Dict, List, Tuple

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)  # roll_gspo from this checkout

import torch  # noqa: E402

GIB = float(1 << 30)
QWEN25_05B = dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                  intermediate_size=4864, vocab_size=151936, max_position_embeddings=32768,
                  tie_word_embeddings=True, rope_theta=1000000.0, rms_norm_eps=1e-6)


class Skip(Exception):
    """The check cannot run here (what is missing is the message)."""


# -- DeepSpeed training steps ---------------------------------------------------------------------------
def _single_process_group() -> None:
    """The environment deepspeed.init_distributed reads, for one rank on this machine."""
    if "MASTER_PORT" not in os.environ:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(probe.getsockname()[1])
    for key, value in (("MASTER_ADDR", "127.0.0.1"), ("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
        os.environ.setdefault(key, value)


def _write_qwen05b_shaped(folder: str) -> str:
    """A Qwen2.5-0.5B-shaped model with random weights (bf16), saved as a model folder."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    with torch.device("cuda"):  # initialising 0.5B parameters on the GPU takes a second, not a minute
        model = Qwen2ForCausalLM(Qwen2Config(**QWEN25_05B)).to(torch.bfloat16)
    model.save_pretrained(folder, safe_serialization=True)
    del model
    torch.cuda.empty_cache()
    return folder


def _train_steps(engine: str, folder: str, steps: int, batch: int, seq_len: int, checkpointing: bool,
                 strategy_config: dict) -> str:
    """`steps` optimizer steps of roll_gspo's training strategy `engine` (deepspeed or fsdp2, bf16)
    on random tokens: seconds per step, peak memory, the loss and that the weights moved."""
    from roll_gspo.schema.config import RoleConfig

    if engine == "fsdp2":
        from roll_gspo.strategies.fsdp2_strategy import FSDP2Strategy as Strategy
    else:
        from roll_gspo.strategies.deepspeed_strategy import DeepSpeedStrategy as Strategy

    _single_process_group()
    role = RoleConfig()
    role.model_args.model_name_or_path, role.model_args.dtype = folder, "bf16"
    role.model_args.gradient_checkpointing = checkpointing
    role.training_args.per_device_train_batch_size, role.training_args.learning_rate = batch, 1e-4
    role.strategy_args.strategy_name = f"{engine}_train"
    role.strategy_args.strategy_config = strategy_config
    torch.cuda.reset_peak_memory_stats()
    strategy = Strategy(role, train=True, total_optimizer_steps=steps, seed=0)
    forward = getattr(strategy, "engine", None) or strategy.module  # DeepSpeed's engine wraps the module
    try:
        vocab = strategy.model_config.vocab_size
        probe = next(strategy.module.parameters())
        before = probe.detach().float().clone() if engine != "fsdp2" else probe.detach().full_tensor().float().clone()
        seconds, losses = [], []
        for _ in range(steps):
            ids = torch.randint(0, vocab, (batch, seq_len), device=strategy.device)
            torch.cuda.synchronize()
            start = time.perf_counter()
            loss = forward(input_ids=ids, labels=ids).loss
            strategy.backward_and_step(loss, boundary=True)
            torch.cuda.synchronize()
            seconds.append(time.perf_counter() - start)
            losses.append(float(loss.detach()))
        after = probe.detach().float() if engine != "fsdp2" else probe.detach().full_tensor().float()
        moved = float((after - before).abs().max())
        peak = torch.cuda.max_memory_allocated() / GIB
        if not all(map(_finite, losses + [strategy.grad_norm()])) or moved == 0.0:
            raise AssertionError(f"losses {losses}, grad norm {strategy.grad_norm()}, weights moved by {moved}")
        steady = seconds[1:] or seconds  # the first step builds the engine's buffers
        return (f"{steps} steps of batch {batch} x {seq_len} tokens, {statistics.median(steady):.3f} s/step "
                f"(first {seconds[0]:.2f} s), peak GPU memory {peak:.2f} GiB, loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    finally:
        del strategy
        torch.cuda.empty_cache()


def _finite(value: float) -> bool:
    return value == value and abs(value) != float("inf")


def check_deepspeed_builtin(args, workdir: str) -> str:
    _needs("deepspeed", "transformers")
    from roll_gspo.builtin.models import build_base_model

    folder = build_base_model(os.path.join(workdir, "builtin-tiny"), seed=0, size="tiny")
    return _train_steps("deepspeed", folder, steps=3 if args.quick else 10, batch=8, seq_len=128, checkpointing=False,
                        strategy_config={"zero_optimization": {"stage": 2}})


def check_deepspeed_qwen05b(args, workdir: str) -> str:
    _needs("deepspeed", "transformers")
    folder = _write_qwen05b_shaped(os.path.join(workdir, "qwen2.5-0.5b-shaped"))
    return _train_steps("deepspeed", folder, steps=3 if args.quick else 6, batch=4, seq_len=1024, checkpointing=True,
                        strategy_config={"zero_optimization": {"stage": 2}})


# -- CUDA IPC hand-off ----------------------------------------------------------------------------------
def _bucket(seed: int, megabytes: int) -> List[Tuple[str, torch.Tensor]]:
    """A weight bucket of mixed dtypes and shapes on the GPU, the same for the same seed."""
    generator = torch.Generator(device="cuda").manual_seed(seed)
    rows = max(1, megabytes * (1 << 20) // (4 * 4096 * 3))
    out = []
    for index, dtype in enumerate((torch.bfloat16, torch.float32, torch.bfloat16)):
        values = torch.randn(rows, 4096, generator=generator, device="cuda")
        out.append((f"layers.{index}.weight", values.to(dtype)))
        out.append((f"layers.{index}.bias", torch.randn(17, generator=generator, device="cuda").to(dtype)))
    return out


def _ipc_receiver(inbox, outbox) -> None:
    """The receiving process: each round's bucket by CUDA IPC through roll_gspo's receiver."""
    from roll_gspo.sync.collective import CollectiveReceiver

    receiver = CollectiveReceiver()  # no group: a worker on the sender's GPU takes buckets by CUDA IPC
    while True:
        job = inbox.get()
        if job is None:
            return
        seed, megabytes, meta = job
        try:
            torch.cuda.synchronize()
            start = time.perf_counter()
            got = receiver.receive(meta)
            torch.cuda.synchronize()
            copied = time.perf_counter() - start
            expected = _bucket(seed, megabytes)
            same = [name for (name, a), (_, b) in zip(got, expected) if a.dtype == b.dtype and torch.equal(a, b)]
            outbox.put(("ok", len(same) == len(expected) == len(got), copied))
        except Exception as exc:  # noqa: BLE001 - reported by the sender's check
            outbox.put(("error", f"{type(exc).__name__}: {exc}", 0.0))


def check_cuda_ipc(args, workdir: str) -> str:
    from dataclasses import replace

    import torch.multiprocessing as mp

    from roll_gspo.sync.collective import bucket_layout, pack_bucket
    from roll_gspo.sync.cuda_ipc import share_buffer

    megabytes, rounds = (64, 3) if args.quick else (256, 8)
    context = mp.get_context("spawn")
    inbox, outbox = context.Queue(), context.Queue()
    receiver = context.Process(target=_ipc_receiver, args=(inbox, outbox), daemon=True)
    receiver.start()
    try:
        hand_off, copy, nbytes = [], [], 0
        for seed in range(rounds):
            bucket = _bucket(seed, megabytes)
            torch.cuda.synchronize()
            start = time.perf_counter()
            # What CollectiveSender.send does for a worker on its GPU: pack, share, keep until answered.
            meta = bucket_layout(bucket)
            flat = pack_bucket(bucket, meta, torch.device("cuda", torch.cuda.current_device()))
            inbox.put((seed, megabytes, replace(meta, ipc=share_buffer(flat))))
            status, result, copied = outbox.get(timeout=300)
            hand_off.append(time.perf_counter() - start)
            del flat
            if status != "ok":
                raise AssertionError(f"receiver: {result}")
            if not result:
                raise AssertionError(f"round {seed}: the receiver's tensors differ from the sender's")
            copy.append(copied)
            nbytes = meta.nbytes
        gbs = nbytes / GIB
        return (f"{rounds} buckets of {nbytes / (1 << 20):.0f} MB bitwise equal; hand-off (pack + share + "
                f"receiver map/copy/unpack + answer) {gbs / statistics.median(hand_off):.1f} GB/s median, "
                f"{gbs / min(hand_off):.1f} best; receiver copy {gbs / statistics.median(copy):.1f} GB/s")
    finally:
        inbox.put(None)
        receiver.join(timeout=60)
        if receiver.is_alive():
            receiver.kill()


# -- generate + score -----------------------------------------------------------------------------------
def check_hf_generate_score(args, workdir: str) -> str:
    _needs("transformers")
    from roll_gspo.builtin.models import build_base_model
    from roll_gspo.models.causal_lm import build_sequences, load_causal_lm, response_token_log_probs

    folder = build_base_model(os.path.join(workdir, "builtin-tiny"), seed=0, size="tiny")
    model = load_causal_lm(folder, "fp32").cuda().eval()
    config = model.config
    batch, prompt_len, new_tokens = 8, 16, 48
    special = {config.pad_token_id, config.eos_token_id}
    allowed = torch.tensor([t for t in range(config.vocab_size) if t not in special])
    generator = torch.Generator().manual_seed(0)
    prompts = allowed[torch.randint(0, len(allowed), (batch, prompt_len), generator=generator)].cuda()
    torch.manual_seed(0)
    with torch.no_grad():
        start = time.perf_counter()
        out = model.generate(prompts, attention_mask=torch.ones_like(prompts), do_sample=True, temperature=1.0,
                             top_k=0, top_p=1.0, max_new_tokens=new_tokens, output_logits=True,
                             return_dict_in_generate=True, pad_token_id=config.pad_token_id,
                             eos_token_id=config.eos_token_id)
        generate_s = time.perf_counter() - start
    sampled = out.sequences[:, prompt_len:]
    # What the sampler saw: the raw logits (temperature 1, no top-k/top-p), log-softmaxed.
    generated = torch.stack([torch.log_softmax(step.float(), dim=-1) for step in out.logits], dim=1)
    generated = generated.gather(-1, sampled[..., None]).squeeze(-1)
    responses = []
    for row in sampled.tolist():  # up to and including the first eos; what follows is padding
        responses.append(row[:row.index(config.eos_token_id) + 1] if config.eos_token_id in row else row)
    input_ids, attention_mask, prompt_lengths, response_mask = build_sequences(
        prompts.tolist(), responses, config.pad_token_id)
    with torch.no_grad():
        scored, _ = response_token_log_probs(model, input_ids.cuda(), attention_mask.cuda(), prompt_lengths,
                                             response_mask.shape[1])
    mask = response_mask.cuda().bool()
    gap = float((scored - generated[:, :mask.shape[1]]).abs()[mask].max())
    tokens = int(mask.sum())
    if gap > 1e-3:
        raise AssertionError(f"max |scored - generated| log-prob gap {gap:.2e} over {tokens} tokens (fp32)")
    return (f"{batch} prompts, {tokens} sampled tokens (fp32, builtin tiny), generate {generate_s:.2f} s; "
            f"max |scoring pass - generation| log-prob gap {gap:.2e}")


# -- FSDP2 ----------------------------------------------------------------------------------------------
def check_fsdp2(args, workdir: str) -> str:
    """roll_gspo's FSDP2 strategy over NCCL on one GPU: bf16 steps of the 0.5B-shaped model."""
    _needs("transformers")
    folder = _write_qwen05b_shaped(os.path.join(workdir, "qwen2.5-0.5b-shaped"))
    return _train_steps("fsdp2", folder, steps=3 if args.quick else 6, batch=4, seq_len=1024, checkpointing=True,
                        strategy_config={})


# -- running --------------------------------------------------------------------------------------------
def _needs(*modules: str) -> None:
    import importlib

    for module in modules:
        try:
            importlib.import_module(module)
        except ImportError as exc:
            raise Skip(f"{module} is not importable here ({exc})") from None


CHECKS: List[Tuple[str, Callable]] = [
    ("deepspeed_builtin", check_deepspeed_builtin),
    ("deepspeed_qwen05b", check_deepspeed_qwen05b),
    ("cuda_ipc", check_cuda_ipc),
    ("hf_generate_score", check_hf_generate_score),
    ("fsdp2", check_fsdp2),
]


def run_check(name: str, check: Callable, args, workdir: str) -> str:
    """The check's line; a third-party module missing is a SKIP, anything else raised a FAIL."""
    try:
        return f"PASS {name}: {check(args, workdir)}"
    except Skip as why:
        return f"SKIP {name}: {why}"
    except ModuleNotFoundError as exc:
        if (exc.name or "").split(".")[0] != "roll_gspo":
            return f"SKIP {name}: {exc.name} is not importable here"
        return f"FAIL {name}: {type(exc).__name__}: {exc}"
    except Exception as exc:  # noqa: BLE001 - every failure is one FAIL line (the trace goes to stderr)
        traceback.print_exc()
        return f"FAIL {name}: {type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"


def machine_lines() -> List[str]:
    lines = [f"# gpu_check {datetime.datetime.now().isoformat(timespec='seconds')} on {platform.node()}, "
             f"python {platform.python_version()}, torch {torch.__version__}, CUDA {torch.version.cuda}"]
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        lines.append(f"# device 0 of {torch.cuda.device_count()}: {props.name}, {props.total_memory / GIB:.1f} GiB, "
                     f"compute capability {props.major}.{props.minor}")
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps, rounds and smaller buckets")
    parser.add_argument("--only", nargs="*", default=None, help="run only these checks (names as printed)")
    args = parser.parse_args(argv)
    print("\n".join(machine_lines()), flush=True)
    chosen = [(n, c) for n, c in CHECKS if args.only is None or n in args.only]
    results: Dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="roll_gspo_gpu_check_") as workdir:
        for name, check in chosen:
            if not torch.cuda.is_available():
                line = f"SKIP {name}: no CUDA device (torch {torch.__version__})"
            else:
                line = run_check(name, check, args, workdir)
            results[name] = line
            print(line, flush=True)
    return 1 if any(line.startswith("FAIL") for line in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
