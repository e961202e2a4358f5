"""The pipeline benchmark's pure helpers (medians, ratios, verdicts, table, overrides). The
benchmark itself (Ray, vLLM, DeepSpeed) is not run here: see benchmarks/README.md."""
import importlib.util
import json
import math
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_pipeline.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_pipeline", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # no heavy import at module level
    return module


def steps(*rows):
    """Pipeline metrics per step from (generate, reward, old_log_probs, train, sync) tuples."""
    out = []
    for gen, rew, old, train, sync in rows:
        m = {"time/generate_s": gen, "time/reward_s": rew, "time/old_log_probs_s": old,
             "time/advantages_s": 0.01, "time/train_s": train, "time/sync_s": sync}
        m["time/step_s"] = sum(m.values())
        out.append(m)
    return out


def test_ratios_verdicts_table_and_overrides(bench):
    # Medians resist one slow step; non-finite values are ignored.
    assert bench.median([1.0, 100.0, 2.0]) == 2.0
    assert bench.median([float("nan"), 3.0]) == 3.0
    assert bench.median([]) is None

    metrics = steps((0.2, 0.1, 0.05, 0.5, 0.04), (0.3, 0.1, 0.05, 0.6, 0.05), (0.2, 0.2, 0.05, 0.5, 0.04))
    med = bench.phase_medians(metrics, wall=[0.91, 5.0, 0.92])
    assert med["generate"] == pytest.approx(0.2) and med["reward"] == pytest.approx(0.1)
    assert med["sync"] == pytest.approx(0.04) and med["step_wall"] == pytest.approx(0.92)
    assert med["step"] == pytest.approx(1.0)  # median of the per-step sums (0.90, 1.11, 1.00)
    assert "reference" not in med  # phases the run did not have are absent, not zero

    # step / (generate + train) and sync / step, against <= 1.15 and <= 5%; boundaries pass.
    ratios = bench.compute_ratios(pipeline_step=1.0, raw_generate=0.2, raw_train=0.6, sync=0.05)
    assert ratios["step_over_raw"]["value"] == pytest.approx(1.25)
    assert ratios["step_over_raw"]["verdict"] == "FAIL"
    assert ratios["sync_over_step"]["value"] == pytest.approx(0.05)
    assert ratios["sync_over_step"]["verdict"] == "PASS"
    ok = bench.compute_ratios(pipeline_step=0.92, raw_generate=0.2, raw_train=0.6, sync=0.06)
    assert ok["step_over_raw"]["verdict"] == "PASS" and ok["sync_over_step"]["verdict"] == "FAIL"
    missing = bench.compute_ratios(pipeline_step=1.0, raw_generate=None, raw_train=0.6, sync=None)
    assert missing["step_over_raw"] == {"value": None, "target": 1.15, "verdict": "N/A"}
    assert bench.verdict(None, 1.0) == "N/A" and bench.ratio(1.0, 0.0) is None

    overrides = bench.build_overrides("builtin:tiny-arith-base", "/tmp/x/out", 7, ["seed=3"])
    assert overrides[:5] == ["pretrain=builtin:tiny-arith-base", "eval_steps=0", "save_steps=0",
                             "output_dir=/tmp/x/out", "max_steps=7"]
    assert overrides[-1] == "seed=3"  # extra overrides come last, so they win

    report = {
        "setup": {"description": "tiny | 16 prompts x G=8", "measured_steps": 3, "warmup_steps": 2,
                  "cpu_count": 2, "load_average_1_5_15min": {"start": [1.5, 1.0, 1.0]}},
        "pipeline": {"median_s": med, "per_step": bench.per_step_lists(metrics, [0.91, 5.0, 0.92])},
        "probe": {"generate": 0.18, "old_log_probs": 0.04, "train": 0.45,
                  "per_step": {"generate": [0.18], "old_log_probs": [0.04], "train": [0.45]}},
        "raw": {"generate": 0.2, "train": 0.6, "old_log_probs": 0.05, "update": 0.55,
                "per_step": {"generate": [0.2, 0.2, 0.2], "train": [0.6, 0.6, 0.6]}},
        "ratios": ratios,
    }
    table = bench.format_table(report)
    json.dumps(report)  # what --json writes must serialise
    lines = table.splitlines()
    assert any(line.startswith("pipeline generate") and "0.200" in line for line in lines)
    assert any(line.startswith("pipeline step (wall time of step())") and "0.920" in line and "5.000" in line
               for line in lines)
    assert any(line.startswith("raw DeepSpeed train") and "0.600" in line for line in lines)
    (step_line,) = [line for line in lines if line.startswith("pipeline step / (raw generate + raw train)")]
    assert step_line.split()[-3:] == ["<=", "1.15", "FAIL"] and "1.250" in step_line
    (sync_line,) = [line for line in lines if line.startswith("sync / step")]
    assert "5.0%" in sync_line and sync_line.endswith("PASS")
    assert "load average on 2 CPUs: start 1.50" in table


def test_cli_defaults(bench):
    args = bench.parse_args([])
    assert (args.warmup, args.steps, args.model, args.probe) == (2, 10, "builtin:tiny-arith-base", True)
    assert args.config.endswith("examples/example_gspo.yaml")
    with pytest.raises(SystemExit):
        bench.parse_args(["--steps", "0"])


def test_logprob_memory_benchmark_smoke():
    """benchmarks/bench_logprob_memory.py at a small size (152k vocabulary, 16 + 256 tokens, the
    scoring pass): the chunked log-prob pass must peak well below the old one (log-probs in bounded memory)."""
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_logprob_memory.py"
    spec = importlib.util.spec_from_file_location("bench_logprob_memory", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    # --parallel: the before and after processes at once (each measures its own process's peak).
    args = module.parse_args(["--prompt-len", "16", "--response-len", "256", "--passes", "scoring", "--parallel"])
    results = module.run(args)
    before, after = results["scoring"]["before"], results["scoring"]["after"]
    one_copy_mb = 272 * 151936 * 4 / 2 ** 20
    assert before["checksum"] == pytest.approx(after["checksum"], rel=1e-5)  # same log-probs
    assert before["peak_mb"] > 2 * one_copy_mb  # the old path holds several logits-sized tensors
    assert after["peak_mb"] < 0.8 * before["peak_mb"]
    table = module.format_table(results, args)
    assert "scoring" in table and "train" not in table.splitlines()[-1]


@pytest.mark.e2e
def test_weight_sync_benchmark_smoke(tmp_path):
    """bench_weight_sync.py --smoke: every transport delivers the micro model (the script checks
    the bytes each receiver got) and reports a time and GB/s."""
    import os
    import subprocess
    import sys

    out = tmp_path / "sync.json"
    script = BENCH.parent / "bench_weight_sync.py"
    env = {**os.environ, "PYTHONPATH": str(BENCH.parents[1])}
    done = subprocess.run([sys.executable, str(script), "--smoke", "--json", str(out)], capture_output=True,
                          text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert [r["transport"] for r in rows] == ["shared_memory", "object_store", "collective"]
    assert all(r["sync_s_median"] > 0 and r["gb_per_s"] > 0 for r in rows)


@pytest.mark.e2e
def test_peers_benchmark_smoke(tmp_path):
    """bench_peers.py --smoke: the pipeline and TRL's GRPOTrainer (HF generate and vLLM colocate)
    each run one cycle on the micro model, one after the other; every column of the table is there and
    every figure is sane. Without TRL its rows must say it is skipped and why."""
    import importlib.util as util
    import os
    import subprocess
    import sys

    out = tmp_path / "peers.json"
    script = BENCH.parent / "bench_peers.py"
    env = {**os.environ, "PYTHONPATH": str(BENCH.parents[1])}
    # pipeline_trainer is the pipeline with one override (another private Ray's start-up): left out.
    done = subprocess.run([sys.executable, str(script), "--smoke", "--variants", "pipeline", "trl_hf", "trl_vllm",
                           "--json", str(out)], capture_output=True,
                          text=True, timeout=900, env=env)
    assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-3000:])
    header = next(line for line in done.stdout.splitlines() if line.startswith("variant"))
    for column in ("cycle", "generate", "score", "old lp", "train", "x pipe", "GFLOP/s", "% peak", "floor",
                   "/floor", "pipeline / TRL's faster"):
        assert column in header, column
    report = json.loads(out.read_text())
    assert 1 < report["peak_gflops"] < 1e5
    (size,) = report["sizes"]
    with_trl = util.find_spec("trl") is not None
    pipelines = {"pipeline"}
    assert set(size["rows"]) == (pipelines | {"trl_hf", "trl_vllm"} if with_trl else pipelines)
    if not with_trl:
        assert all("TRL is not installed" in why for why in size["skipped"].values())
        assert "skipped: TRL is not installed" in done.stdout
    for variant, row in size["rows"].items():
        phases = row["phases_s"]
        assert row["cycle_s"] > 0 and phases["generate"] > 0 and phases["train"] > 0, (variant, row)
        assert sum(phases[p] for p in ("generate", "score", "old_log_probs", "train")) <= row["cycle_s"] * 1.05
        assert 0 < row["gflops_per_s"] < 2 * report["peak_gflops"] and row["cycle_over_floor"] > 0.5
        assert row["peak_rss_mb"] and all(50 < mb < 20000 for mb in row["peak_rss_mb"].values()), row["peak_rss_mb"]
        assert row["flops"]["total"] > row["flops"]["floor"] if row["old_log_prob_pass"] else True
    assert size["rows"]["pipeline"]["cycle_over_pipeline"] == 1.0
    assert "peak RSS MB per process: pipeline: driver" in done.stdout
    assert report["cpu"]["model"] and set(report["cpu"]["flags"]) == {"AVX2", "AVX512F", "AVX512-BF16", "AMX"}
    assert "[bench] CPU: " in done.stdout and "summary (CPU: " in done.stdout
    if with_trl:
        verdict = size["against_faster_trl"]
        assert verdict["variant"] in ("trl_hf", "trl_vllm") and verdict["ratio"] > 0 and verdict["goal"] is None
    # The micro model's default (seq ratios, fp32, temperature 1): old log-probs from vLLM, no pass.
    assert size["old_logprob_sources"] == {"pipeline": "rollout"}
    assert size["rows"]["pipeline"]["phases_s"]["old_log_probs"] == 0.0


@pytest.fixture(scope="module")
def peers():
    spec = importlib.util.spec_from_file_location("bench_peers", BENCH.parent / "bench_peers.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # no heavy import at module level
    return module


def test_peers_cpu_flags_from_cpuinfo(peers):
    """bench_peers names the CPU it ran on: the first model name, the processors counted, and the
    flags that decide small-model speed read from the first flags line as whole words (avx512f
    is not avx512_bf16; a flag's prefix is not the flag)."""
    text = ("processor\t: 0\nmodel name\t: AMD EPYC 7B13\nflags\t\t: fpu avx avx2 fma avx512fx\n\n"
            "processor\t: 1\nmodel name\t: AMD EPYC 7B13\nflags\t\t: fpu avx avx2 fma avx512fx\n")
    cpu = peers.cpu_description(text)
    assert cpu == {"model": "AMD EPYC 7B13", "cores": 2,
                   "flags": {"AVX2": True, "AVX512F": False, "AVX512-BF16": False, "AMX": False}}
    xeon = peers.cpu_description("processor : 0\nmodel name : Intel(R) Xeon(R) Processor\n"
                                 "flags : avx2 avx512f avx512_bf16 amx_bf16 amx_tile\n")
    assert xeon["flags"] == {"AVX2": True, "AVX512F": True, "AVX512-BF16": True, "AMX": True}
    assert peers.format_cpu(cpu) == ("CPU: AMD EPYC 7B13, 2 logical cores; AVX2 yes, AVX512F no, AVX512-BF16 no, "
                                     "AMX no")
    assert peers.cpu_description("") == {"model": "unknown", "cores": 0,
                                         "flags": dict.fromkeys(("AVX2", "AVX512F", "AVX512-BF16", "AMX"), False)}


def test_peers_ratio_against_trls_faster_variant_and_goal(peers):
    """The last column: TRL's faster cycle / the pipeline's, whichever TRL variant is faster, met
    at exactly the goal, missed below it; no goal, no verdict; no TRL row, no ratio."""
    def rows(**cycles):
        return {variant: {"cycle_s": seconds} for variant, seconds in cycles.items()}

    # the 1M row: TRL-HF 0.440, TRL-vLLM 0.709, pipeline 0.487 -> 0.90x, goal 1.0 missed
    verdict = peers.against_faster_trl(rows(pipeline=0.487, trl_hf=0.440, trl_vllm=0.709), 1.0)
    assert verdict["variant"] == "trl_hf" and verdict["ratio"] == pytest.approx(0.440 / 0.487)
    assert verdict["met"] is False
    assert peers.format_verdict(verdict) == "0.90x trl_hf, goal >= 1x MISSED"
    verdict = peers.against_faster_trl(rows(pipeline=2.0, trl_hf=9.0, trl_vllm=3.0), 1.5)
    assert (verdict["variant"], verdict["ratio"], verdict["met"]) == ("trl_vllm", 1.5, True)
    assert peers.format_verdict(verdict) == "1.50x trl_vllm, goal >= 1.5x met"
    verdict = peers.against_faster_trl(rows(pipeline=2.0, trl_hf=2.6), None)
    assert verdict["met"] is None and peers.format_verdict(verdict) == "1.30x trl_hf"
    verdict = peers.against_faster_trl(rows(pipeline=2.0), 1.3)
    assert verdict["ratio"] is None and peers.format_verdict(verdict) == "-"
    # another pipeline row is compared the same way
    verdict = peers.against_faster_trl(rows(pipeline=2.0, pipeline_x=1.0, trl_hf=2.6), 1.3, "pipeline_x")
    assert verdict["ratio"] == pytest.approx(2.6) and verdict["met"]
    # the goals the issue sets, on the sizes it names
    assert {name: size.get("goal") for name, size in peers.SIZES.items() if size.get("goal")} == {
        "builtin": 1.0, "20m": 1.3, "smollm2": 1.5, "smollm2-32": 1.5}
    assert peers.parse_args([]).variants == ["pipeline", "trl_hf", "trl_vllm"]
    # --reps-at: more cycles where they are cheap; a size or count that is not one is refused
    assert peers.parse_args(["--reps-at", "builtin=5", "--reps-at", "20m=3"]).reps_at == [("builtin", 5), ("20m", 3)]
    for bad in ("tiny=3", "builtin=0", "builtin=x", "builtin"):
        with pytest.raises(SystemExit):
            peers.parse_args(["--reps-at", bad])


def test_peers_summary_table_names_the_cpu_and_each_sizes_verdict(peers):
    report = {"cpu": peers.cpu_description("model name : Xeon\nflags : avx2\n"), "sizes": []}
    for name, cycles in (("builtin", {"pipeline": 0.487, "trl_hf": 0.440, "trl_vllm": 0.709}),
                         ("20m", {"pipeline": 8.28, "trl_hf": 10.97})):
        rows = {v: {"cycle_s": c} for v, c in cycles.items()}
        report["sizes"].append({"size": name, "rows": rows,
                                "against_faster_trl": peers.against_faster_trl(rows, peers.SIZES[name]["goal"])})
    lines = peers.format_summary(report)
    assert "CPU: Xeon, 0 logical cores; AVX2 yes, AVX512F no" in lines[1]
    assert lines[3].split() == ["builtin", "0.440", "0.709", "0.487", "0.90x", "trl_hf,", "goal", ">=", "1x", "MISSED"]
    assert lines[4].split() == ["20m", "10.970", "-", "8.280", "1.32x", "trl_hf,", "goal", ">=", "1.3x", "met"]


def test_scaling_table_puts_each_step_beside_its_flop_floor():
    """bench_scaling.py's table: floor = FLOPs / matmul peak, and each row's growth in FLOPs and in
    time against the series' first row (the benchmark itself runs pipelines: not here)."""
    spec = importlib.util.spec_from_file_location("bench_scaling", BENCH.parent / "bench_scaling.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)

    def row(model, length, step, flops):
        return {"model": model, "response_length": length, "parameters": 19e6, "step_s": step, "generate_s": 1.0,
                "train_s": step - 1.0, "response_tokens": 32 * length, "flops": flops, "peak_rss_max_mb": 1200.0,
                "peak_rss_sum_mb": 4000.0}

    report = {"reps": 3, "warmup": 1, "peak_gflops": 100.0, "peak_before": 90.0, "peak_after": 100.0,
              "load_start": 0.5, "load_end": 0.7,
              "series": {"length": [row("19m", 32, 2.0, 100e9), row("19m", 128, 6.0, 400e9)]}}
    table = module.format_report(report)
    lines = table.splitlines()
    header = next(i for i, line in enumerate(lines) if "floor s" in line)
    first, second = lines[header + 1].split(), lines[header + 2].split()
    columns = lines[header].split()
    assert columns == ["model", "params", "resp", "tokens", "step", "s", "gen", "s", "train", "s", "TFLOP", "floor", "s",
                       "/floor", "x", "FLOPs", "x", "time", "RSS", "max", "RSS", "sum"]
    assert first[-6:-2] == ["1.00", "2.00", "1.00", "1.00"]  # floor 1 s (100 GFLOP at 100 GFLOP/s), 2x it
    assert second[-6:-2] == ["4.00", "1.50", "4.00", "3.00"]  # 4x the FLOPs in 3x the time
    assert "100.0 GFLOP/s" in lines[0]


def test_scaling_attainable_floor_times_generation_at_its_decode_speed(tmp_path):
    """bench_scaling.py's second floor: prefill at the peak, each decoded token at one measured
    decode step of the model's own linear shapes, training at the peak; the table shows it."""
    spec = importlib.util.spec_from_file_location("bench_scaling", BENCH.parent / "bench_scaling.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "intermediate_size": 128, "vocab_size": 100}
    (tmp_path / "config.json").write_text(json.dumps(config))
    shapes = module.linear_shapes(str(tmp_path))  # q/k/v fused (64 + 2 x 2 heads x 16), o, gate/up, down; head
    assert shapes == [(64, 128), (64, 64), (64, 256), (128, 64)] * 2 + [(64, 100)]
    assert 0 < module.measure_decode_step(str(tmp_path), rows=4, reps=1) < 5
    row = {"parameters": 1e9, "prompt_tokens": 1000.0, "response_tokens": 3200.0, "decode_step_s": 0.5}
    floor = module.attainable_floor(row, peak_gflops=100.0)
    sequences = module.PROMPTS * module.GROUP  # 32: 100 decode steps of 0.5 s, prefill 2 TFLOP at 0.1 TFLOP/s
    assert sequences == 32 and floor["generate"] == pytest.approx(20 + 50)
    assert floor["train"] == pytest.approx(6e9 * 4200 / 1e11) and floor["total"] == floor["generate"] + floor["train"]
    row.update(model="1b", response_length=100, step_s=2 * floor["total"], generate_s=80.0, train_s=300.0,
               flops=1e13, peak_rss_max_mb=1.0, peak_rss_sum_mb=2.0,
               phases_s=dict(generate=80.0, old_log_probs=0.0, train=300.0, sync=1.0, driver=0.0))
    table = module.format_report({"reps": 1, "warmup": 0, "peak_gflops": 100.0, "peak_before": 100.0,
                                  "peak_after": 100.0, "load_start": 0.0, "load_end": 0.0, "series": {"size": [row]}})
    line = next(line for line in table.splitlines() if line.split()[:2] == ["1b", "100"] and "/attainable" not in line
                and len(line.split()) == 13)
    assert line.split()[-2:] == ["70.00", "2.00"]
    assert module.parse_args(["--micro-batch", "8"]).micro_batch == 8
    for bad in ("0", "3"):  # refused before anything runs, naming the flag
        with pytest.raises(SystemExit):
            module.parse_args(["--micro-batch", bad])


def test_async_benchmark_quick(tmp_path, tiny_model):
    """bench_async.py --quick: a synchronous and a request-pool mode (0 and 2: the two ways a step's
    generation is timed; 1 and 4 run the same code with another k) run their steps on the micro
    model and the table and JSON hold every column; no figure is compared (times are the real
    run's, docs/benchmarks.md)."""
    import os
    import subprocess
    import sys

    out = tmp_path / "async.json"
    env = {**os.environ, "PYTHONPATH": str(BENCH.parents[1])}
    done = subprocess.run([sys.executable, str(BENCH.parent / "bench_async.py"), "--quick", "--model", tiny_model,
                           "--modes", "sync", "k2", "--override", "validation.data_args.max_samples=8",  # plumbing only
                           "--json", str(out)], capture_output=True, text=True, timeout=900, env=env)
    assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-3000:])
    header = next(line for line in done.stdout.splitlines() if line.startswith("mode"))
    for column in ("tokens/s", "rollout idle", "trainer idle", "stale max", "dropped", "val acc", "samples"):
        assert column in header, column
    report = json.loads(out.read_text())
    assert [(r["mode"], r["async_generation_ratio"]) for r in report["modes"]] == [
        ("sync", 0), ("k2", 2)]
    for row in report["modes"]:
        assert len(row["step_walls"]) == 3 and row["samples"] == 16 and row["val_accuracy"] is not None, row
        assert 0.0 <= row["rollout_idle_frac"] <= 1.0 and 0.0 <= row["trainer_idle_frac"] <= 1.0, row
        assert row["staleness_max"] <= row["async_generation_ratio"], row


def test_chaos_reshape_gaps_per_resumed_step():
    """bench_chaos's reshape part: resumed minus uninterrupted per step after the checkpoint, the
    largest absolute gap, and the overrides of each resume (1 rank keeps the mini-batches)."""
    spec = importlib.util.spec_from_file_location("bench_chaos", BENCH.parent / "bench_chaos.py")
    chaos = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(chaos)
    uninterrupted = [{"step": 0, "val/accuracy": 0.5}, {"step": 1, "actor/pg_loss": 0.1, "reward/mean": 0.4},
                     {"step": 2, "actor/pg_loss": 0.2, "actor/grad_norm": 1.0, "reward/mean": 0.5},
                     {"step": 3, "actor/pg_loss": 0.3, "actor/grad_norm": 2.0, "reward/mean": 0.6},
                     {"step": 3, "val/accuracy": 0.7}]  # the final validation's own row, merged into step 3
    resumed = [{"step": 2, "actor/pg_loss": 0.25, "actor/grad_norm": 1.5, "reward/mean": 0.5},
               {"step": 3, "actor/pg_loss": 0.1, "actor/grad_norm": 2.0, "reward/mean": 0.6, "val/accuracy": 0.6}]
    gap = chaos.drift(uninterrupted, resumed, after_step=1)
    assert gap["steps"] == [2, 3]
    assert gap["per_step"][2] == pytest.approx({"actor/pg_loss": 0.05, "actor/grad_norm": 0.5, "reward/mean": 0.0})
    assert gap["per_step"][3]["actor/pg_loss"] == pytest.approx(-0.2)
    assert gap["max_abs"] == pytest.approx({"actor/pg_loss": 0.2, "actor/grad_norm": 0.5, "reward/mean": 0.0})
    assert chaos.drift(uninterrupted, resumed[:1], after_step=2)["max_abs"]["actor/pg_loss"] is None  # no step after 2
    assert chaos.validation(resumed) == {"val/accuracy": 0.6}

    cases = chaos.reshape_cases(world_size=2, accumulation=3)
    one, fsdp2 = cases.values()
    assert one == ["actor_train.world_size=1", "actor_train.training_args.gradient_accumulation_steps=6"]
    assert "actor_train.strategy_args.strategy_name=fsdp2_train" in fsdp2
    result = {"save_step": 1, "steps": 3, "shape": "DeepSpeed ZeRO-2, 2 ranks, fp32",
              "uninterrupted": {"exit_code": 0, "wall_s": 9.0, "validation": {"val/accuracy": 0.7}},
              "resumes": {"1 rank": {"exit_code": 0, "wall_s": 8.0, "decision": "actor_train: converted",
                                     "validation": {"val/accuracy": 0.6}, "gap": gap}}}
    text = chaos.reshape_table(result)
    json.dumps(result)
    assert "| 1 rank | 3 | -0.2 | +0 | +0 |" in text and "| 1 rank | max abs | 0.2 | 0.5 | 0 |" in text
    assert "1 rank: exit 0, 8 s, final val/accuracy 0.6000; actor_train: converted" in text


def test_rollout_files_benchmark_figures_and_its_bound(tmp_path):
    """bench_rollout_files.py: the record phase's share and the size per 100 steps from a run's
    metrics; exit 1 when a step spends over 2 % writing its samples."""
    import subprocess
    import sys

    from benchmarks.bench_rollout_files import cost_figures

    rows = [{"step": 0, "rollouts/val_bytes": 2000.0},
            {"step": 1, "time/record_s": 0.01, "time/step_s": 10.0, "rollouts/train_bytes": 1000.0},
            {"step": 2, "time/record_s": 0.03, "time/step_s": 10.0, "rollouts/train_bytes": 3000.0}]
    figures = cost_figures(rows, steps_per_eval=5)
    assert figures["share_max"] == pytest.approx(0.003) and figures["train_bytes_per_step"] == 2000.0
    assert figures["mb_per_100_steps"] == pytest.approx((100 * 2000 + 20 * 2000) / 1e6)
    with pytest.raises(ValueError, match="time/record_s"):
        cost_figures([{"step": 0}], 5)
    slow = rows[:2] + [{"step": 2, "time/record_s": 0.5, "time/step_s": 10.0, "rollouts/train_bytes": 10.0}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in slow))
    done = subprocess.run([sys.executable, str(BENCH.parent / "bench_rollout_files.py"), str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "largest 5.000 %   (bound 2 %)" in done.stdout, done.stdout + done.stderr
    empty = subprocess.run([sys.executable, str(BENCH.parent / "bench_rollout_files.py"), str(tmp_path / "none")],
                           capture_output=True, text=True, timeout=120)
    assert empty.returncode == 2 and empty.stderr.strip().endswith("is not a run folder (no metrics.jsonl)")


# --------------------------------------------------------------------------------------------
# study_policy_losses.py: its arms (each loss's documented defaults, nothing per arm) and its table
# --------------------------------------------------------------------------------------------
def test_policy_loss_study_arms_run_their_loss_with_its_defaults():
    """Every arm loads on the built-in GSPO example as the loss it names, writes none of the loss's
    own keys (its documented defaults run), and only the keys that make the loss; the OPD arm needs
    a teacher."""
    from benchmarks import study_policy_losses as study
    from roll_gspo.catalog.policy_losses import LOSS_SPECS
    from roll_gspo.config import load_config
    from roll_gspo.config.checks.policy_loss import GMPO_LOG_CLIP

    assert study.GMPO_LOG_CLIP == GMPO_LOG_CLIP
    expected = {"gspo": ("clip", "seq", "seq-mean-token-mean", 3e-3), "gspo_token": ("clip", "gspo-token",
                                                                                     "seq-mean-token-mean", 3e-3),
                "grpo": ("clip", "token", "token-mean", 0.2), "cispo": ("cispo", "token", "token-mean", 3e-3),
                "sapo": ("sapo", "token", "token-mean", 3e-3), "gmpo": ("gmpo", "seq", "seq-mean-token-mean", 0.4),
                "luspo": ("luspo", "seq", "seq-mean-token-sum", 3e-3), "vespo": ("vespo", "seq", "seq-mean-token-mean", 3e-3),
                "opd": ("clip", "gspo-token", "seq-mean-token-mean", 3e-3)}
    assert list(study.ARMS) == list(expected)  # opd after gspo: its default teacher is the gspo run
    own_keys = {key for spec in LOSS_SPECS.values() for key in spec.keys}
    for arm, (loss, ratio, agg, clip) in expected.items():
        overrides = study.run_overrides(arm, 3, 2, 1, teacher="builtin:tiny-arith")
        assert not {o.split("=")[0] for o in overrides} & own_keys, arm
        assert overrides[:5] == ["seed=3", "max_steps=2", "eval_steps=1", "save_steps=0", "track_with=none"]
        cfg = load_config(str(study.REPO_ROOT / study.MODELS["builtin"]), overrides)
        assert (cfg.policy_loss, cfg.importance_sampling, cfg.loss_agg_mode, cfg.pg_clip_low) == (loss, ratio, agg, clip)
        assert cfg.use_opd == (arm == "opd"), arm
    assert study.run_overrides("gspo", 0, 2, 1, extra=["seed=9"])[-1] == "seed=9"  # extra overrides win
    with pytest.raises(ValueError, match="arm opd needs a teacher"):
        study.arm_overrides("opd")
    with pytest.raises(ValueError, match="unknown arm 'ppo'"):
        study.arm_overrides("ppo")


def _study_records(accs, clip, gauge_key=None, gauge=0.0, entropy=0.5):
    """A run's metrics.jsonl: validations at steps 0, 2, 4 (`accs`: task -> three accuracies), 4 steps."""
    rows = []
    for i, step in enumerate((0, 2, 4)):
        rows.append({"step": step, **{f"val/{t}/accuracy": a[i] for t, a in accs.items()}, "val/accuracy": 0.0})
    for step in (1, 2, 3, 4):
        row = {"step": step, "actor/pg_loss": 0.1, "actor/clipfrac": clip, "actor/entropy": entropy * step,
               "response/length_mean": 3.0, "reward/mean": 0.5, "rollout/logprob_gap": 1e-6, "time/step_s": 2.0}
        if gauge_key:
            row[gauge_key] = gauge
        rows.append(row)
    return sorted(rows, key=lambda r: r["step"])


def test_policy_loss_study_summary_table_and_separation():
    from benchmarks import study_policy_losses as study

    one = study.run_summary("sapo", _study_records({"a": [0.2, 0.5, 0.6], "b": [0.4, 0.4, 0.8]}, 0.1,
                                                    "actor/sapo_gate_off_frac", 0.25), wall_s=30.0)
    assert one["acc_first"] == {"a": 0.2, "b": 0.4} and one["acc_last"] == {"a": 0.6, "b": 0.8}
    assert one["mean_first"] == pytest.approx(0.3) and one["delta"] == pytest.approx(0.4)
    assert one["mean_run"] == pytest.approx((0.45 + 0.7) / 2)  # validations after step 0 only
    assert one["drawdown"] == 0.0
    fell = study.run_summary("gspo", _study_records({"a": [0.2, 0.7, 0.5]}, 0.1))
    assert fell["drawdown"] == pytest.approx(0.2) and fell["delta"] == pytest.approx(0.3)
    assert (one["gauge"], one["clipfrac"], one["entropy"], one["steps"]) == (0.25, 0.1, 2.0, 4)  # entropy: last quarter
    cispo = study.run_summary("cispo", _study_records({"a": [0.2, 0.3, 0.4]}, 0.1, "actor/cispo_clipfrac_low", 0.05))
    assert math.isnan(cispo["gauge"])  # one of its two keys missing: no gauge, not half of one
    runs = {"gspo": {0: study.run_summary("gspo", _study_records({"a": [0.2, 0.5, 0.6]}, 0.4)),
                     1: study.run_summary("gspo", _study_records({"a": [0.2, 0.5, 0.62]}, 0.4))},
            "grpo": {0: study.run_summary("grpo", _study_records({"a": [0.2, 0.6, 0.8]}, 0.02)),
                     1: study.run_summary("grpo", _study_records({"a": [0.2, 0.6, 0.82]}, 0.02))},
            "sapo": {0: study.run_summary("sapo", _study_records({"a": [0.2, 0.5, 0.5]}, 0.0)),
                     1: study.run_summary("sapo", _study_records({"a": [0.2, 0.5, 0.7]}, 0.0))}}
    table = study.build_table(runs, {"cispo": "seed 0: RuntimeError: boom"})
    assert table["gspo"]["mean_last"] == pytest.approx(0.61) and table["gspo"]["seeds"] == 2
    assert table["cispo"] == {"seeds": 0, "failed": "seed 0: RuntimeError: boom"}
    verdicts = study.separation(table)
    assert any(v.startswith("grpo: 0.810 vs gspo 0.610 (+0.200") and v.endswith("ABOVE") for v in verdicts)
    assert any(v.startswith("sapo:") and v.endswith("within seed noise") for v in verdicts)
    assert study.separation({"grpo": table["grpo"]}) == ["no gspo arm: nothing to compare against"]
    text = study.markdown_table(table, {"opd": "no teacher"})
    lines = text.splitlines()
    assert lines[0].startswith("| arm | loss | seeds | acc step 0 | acc a | acc mean | Δ acc | acc over run | val drawdown | "
                           "clip frac")
    assert all(line.count("|") == lines[0].count("|") for line in lines), text  # every row has every column
    assert "| gspo | GSPO (clip, seq) | 2 | 0.200 ± 0.000 | 0.610 ± 0.014 |" in text
    assert "| cispo | CISPO | failed: seed 0: RuntimeError: boom |" in text
    assert "| opd | OPD + task reward (GSPO-token) | not run: no teacher |" in text
    assert "gate < 0.5: " in text  # the loss's own gauge, named
