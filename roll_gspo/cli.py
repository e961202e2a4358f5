"""`python run_pipeline.py --config NAME [overrides...]`: load, check, then run a pipeline."""
from __future__ import annotations

import argparse
import logging
import sys
from typing import List, Optional

from roll_gspo.config import ConfigError, config_to_yaml, load_config, preflight
from roll_gspo.utils.logging import setup_logging

logger = logging.getLogger("roll_gspo")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="run_pipeline.py",
        description="Run a roll_gspo pipeline from one YAML config plus Hydra-style overrides.",
        epilog="Overrides use Hydra's grammar: key=value, +new.key=value, ~key. "
               "Example: run_pipeline.py --config example_gspo.yaml max_steps=2 "
               "actor_train.training_args.learning_rate=1e-6")
    parser.add_argument("--config", required=True,
                        help="YAML path, or a name found in examples/ or configs/ (e.g. example_gspo.yaml)")
    parser.add_argument("--print-config", action="store_true",
                        help="print the resolved config (defaults filled in) and exit")
    parser.add_argument("--dry-run", action="store_true",
                        help="validate config, data files, model folder and reward functions without "
                             "starting Ray, and print the placement plan (which role's ranks sit on which "
                             "node and GPU) and what a resume will do with its checkpoint (exact, resharded, "
                             "converted, or refused with the reason); exit 0 if all is well, 1 with the errors "
                             "otherwise")
    cluster = parser.add_argument_group(
        "cluster for the --dry-run placement plan",
        "Describe the cluster (--nodes, --gpus-per-node, --device-memory-gb) or read it from a running "
        "Ray cluster (--ray-address, or RAY_ADDRESS when neither is given); the plan is then checked "
        "against it: GPUs that do not exist, too few nodes or GPUs, memory per device.")
    cluster.add_argument("--nodes", type=int, default=None,
                         help="nodes in the cluster, each with --gpus-per-node GPUs")
    cluster.add_argument("--gpus-per-node", type=int, default=None,
                         help="GPUs per node (default: the config's num_gpus_per_node, which also says how "
                              "device_mapping's GPU indices map to nodes)")
    cluster.add_argument("--device-memory-gb", type=float, default=None,
                         help="memory of each GPU in GiB: estimate memory per device (weights, gradients, "
                              "optimizer states by ZeRO stage, activations, vLLM's share and KV cache; ranks "
                              "sharing a GPU add up) and exit 1 naming the device that does not fit, by how much")
    parser.add_argument("--host-memory-gb", type=float, default=None,
                        help="with --dry-run on a CPU run: plan against a host of this much memory (GiB) instead "
                             "of this machine's; the plan adds up every process's peak (training ranks, vLLM, "
                             "rewards, driver and Ray) and exits 1 naming the role, its estimate and the keys "
                             "that would make it fit")
    cluster.add_argument("--ray-address", default=None,
                         help="read the nodes (GPUs, CPUs) from the running Ray cluster at this address "
                              "(joins as a driver; starts no worker)")
    parser.add_argument("overrides", nargs="*", help="Hydra-style overrides")
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_intermixed_args(argv)  # overrides may come before and after the flags
    if args.device_memory_gb is not None and (not args.dry_run or args.device_memory_gb <= 0):
        # Accepted flags act: the estimate only runs with --dry-run, for a positive device size.
        parser.error("--device-memory-gb needs --dry-run and a size > 0 (GiB per device)")
    for flag, value in (("--nodes", args.nodes), ("--gpus-per-node", args.gpus_per_node)):
        if value is not None and (not args.dry_run or value < 1):
            parser.error(f"{flag} needs --dry-run and a number >= 1")
    if args.host_memory_gb is not None and (not args.dry_run or args.host_memory_gb <= 0):
        parser.error("--host-memory-gb needs --dry-run and a size > 0 (GiB of host memory)")
    if args.ray_address is not None and (not args.dry_run or args.nodes is not None):
        parser.error("--ray-address needs --dry-run and replaces --nodes (the nodes are read from Ray)")
    setup_logging()
    # A GPU config run (or dry-run) on a machine without a GPU and without a cluster to plan or join
    # runs on CPUs: the roles' GPU placement is dropped with a notice (roll_gspo.config.plan.cpu_run).
    described = any(value is not None for value in (args.nodes, args.gpus_per_node, args.device_memory_gb,
                                                     args.ray_address))
    try:
        cfg = load_config(args.config, args.overrides, cpu_host=False if described else None)
        if args.print_config:
            print(config_to_yaml(cfg), end="")
            return 0
        preflight(cfg)
    except (ConfigError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if args.dry_run:
        from roll_gspo.config.plan.run_plan import build_run_plan, freeze_config

        freeze_config(cfg)  # nothing below changes the config: what it decides is the plan
        plan = build_run_plan(cfg)
        print(plan.text())
        resumable = _resume_fits(cfg)
        placed = _placement_plan_fits(cfg, args)
        if not (_host_plan_fits(cfg, args) and placed and resumable):
            return 1
        if plan.pipeline == "agentic":
            from roll_gspo.agentic.episodes import describe_episodes

            print("\n".join(describe_episodes(cfg)))
        print(f"dry run: config {args.config!r} is valid ({plan.pipeline} pipeline, "
              f"{cfg.max_steps} steps, output in {cfg.output_dir})")
        return 0
    from pipelines import run_pipeline_from_config
    from roll_gspo.config.plan.run_plan import freeze_config
    from roll_gspo.distributed.cluster import WorkerDiedError
    from roll_gspo.schema import replaced

    freeze_config(cfg)  # read-only from here on: what the run decides goes into its plan
    resumes = 0
    while True:
        try:
            run_pipeline_from_config(cfg)
            return 0
        except WorkerDiedError as exc:
            checkpoint = _auto_resume_from(cfg, exc, resumes)
            if checkpoint is None:  # the line names the rank, its phase, and the command that resumes the run
                from roll_gspo.lifecycle.graceful_stop import resume_command

                print(f"error: {exc}. Resume with: {resume_command()}", file=sys.stderr)
                return 1
            print(f"error: {exc}", file=sys.stderr)
            resumes += 1
            from roll_gspo.distributed.cluster import wait_until_stopped

            wait_until_stopped()  # the stopped run's processes gone (their memory back) before new ones start
            print(f"auto resume {resumes} of {cfg.fault_tolerance.auto_resume_on_failure} "
                  f"(fault_tolerance.auto_resume_on_failure): resuming from {checkpoint}", file=sys.stderr)
            cfg = replaced(cfg, {"resume_from_checkpoint": "auto"})
        except KeyboardInterrupt as exc:  # a second SIGINT/SIGTERM, or Ctrl-C before the step loop
            print(f"stopped at once ({exc or 'interrupted'}); resume from the last complete checkpoint with "
                  f"resume_from_checkpoint=auto", file=sys.stderr)
            return 130
        except Exception as exc:  # noqa: BLE001 - one line for what the run's own errors say
            return _report_failure(exc)


def _auto_resume_from(cfg, exc: BaseException, used: int) -> Optional[str]:
    """The checkpoint `fault_tolerance.auto_resume_on_failure` resumes from after `exc`, or None."""
    from roll_gspo.lifecycle.checkpoint import checkpoint_base
    from roll_gspo.distributed.cluster import RestartsExhaustedError, is_memory_kill
    from roll_gspo.distributed.fault_tolerance import auto_resume_checkpoint
    from roll_gspo.lifecycle.checkpoint import complete_checkpoints

    # A rank that cannot be replaced died; not: replacements ran out, Ray's memory monitor (it would again).
    resumable = not isinstance(exc, RestartsExhaustedError) and not is_memory_kill(exc.__cause__ or exc)
    limit = cfg.fault_tolerance.auto_resume_on_failure
    found = auto_resume_checkpoint(resumable, used, limit, complete_checkpoints(checkpoint_base(cfg)) if limit else [])
    if found is None and resumable and limit and used < limit:
        print("auto resume: no complete checkpoint to resume from (save_steps)", file=sys.stderr)
    return found


def _report_failure(exc: Exception) -> int:
    """Exit code 1 with one line for a failed run (nothing started, a checkpoint that could not be
    written, an error the user caused (`USER_CAUSED`), a worker killed for memory or raising); `exc`
    is raised again when it is none of those."""
    from roll_gspo.distributed.cluster import describe_memory_kill, describe_worker_error, is_memory_kill, known_rank_pids
    from roll_gspo.lifecycle.checkpoint import CheckpointError
    from roll_gspo.placement.device_mapping import PlacementError

    if isinstance(exc, (PlacementError, CheckpointError)):  # PlacementError: the cluster cannot hold the device_mapping
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if is_memory_kill(exc):  # Ray's memory monitor, where no cluster's gather saw it: one line too
        print(f"error: {describe_memory_kill(str(exc), known_rank_pids())}", file=sys.stderr)
        return 1
    # An exception raised in a rank's method: one line naming the rank and the log file that holds
    # its trace (Ray's 100-line remote traceback goes to the driver's log file, not the console).
    message = describe_worker_error(exc)
    if message is None and isinstance(exc, USER_CAUSED):  # the driver's own: its message says what to do
        message = str(exc)
    if message is None:
        raise exc
    _trace_to_log_file(exc)
    print(f"error: {message}", file=sys.stderr)
    return 1


# Errors a user causes with what the run reads (an output_dir already holding checkpoints, a missing
# or unreadable file, data that does not fit the config): one console line, the trace to the log
# file. A ValueError is a value out of range or a shape that does not fit, by Python's convention;
# programming errors (TypeError, KeyError, AttributeError, ...) keep their traceback.
USER_CAUSED = (FileExistsError, FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError, ValueError)


def _trace_to_log_file(exc: BaseException) -> None:
    import traceback

    from roll_gspo.utils.logging import trace_to_log_file

    trace_to_log_file("".join(traceback.format_exception(exc)).rstrip())


def _resume_fits(cfg) -> bool:
    """Print what the resume will do (exact, resharded, converted) or why it is refused."""
    from roll_gspo.lifecycle.checkpoint import checkpoint_base
    from roll_gspo.lifecycle.reshape import describe_resume

    lines, problems = describe_resume(cfg, checkpoint_base(cfg))
    for line in lines:
        print(line)
    for problem in problems:
        print(f"error: {problem}", file=sys.stderr)
    return not problems


def _placement_plan_fits(cfg, args) -> bool:
    """Print the placement plan against the described (or running) cluster and its problems."""
    import os

    from roll_gspo.placement.cluster_plan import ClusterSpec, plan_cluster

    gpus_per_node = args.gpus_per_node or cfg.num_gpus_per_node
    address = args.ray_address or (os.environ.get("RAY_ADDRESS") if args.nodes is None else None)
    if args.nodes is not None:
        cluster = ClusterSpec.described(args.nodes, gpus_per_node, args.device_memory_gb)
    elif address:
        try:
            cluster = ClusterSpec.from_ray_nodes(_ray_nodes(address), gpus_per_node, args.device_memory_gb, address)
        except Exception as exc:  # no cluster answers: the plan is still printed, unchecked
            if args.ray_address:
                print(f"error: --ray-address {address}: cannot read the cluster's nodes ({exc})", file=sys.stderr)
                return False
            print(f"(RAY_ADDRESS={address} does not answer ({type(exc).__name__}); plan not checked against it)")
            cluster = ClusterSpec(gpus_per_node, device_memory_gib=args.device_memory_gb)
    else:
        cluster = ClusterSpec(gpus_per_node, device_memory_gib=args.device_memory_gb,
                              source=f"not described (nodes of {gpus_per_node} GPUs; --nodes/--gpus-per-node/"
                                     f"--device-memory-gb or --ray-address check it)")
    plan = plan_cluster(cfg, cluster)
    print(plan.text())
    if args.device_memory_gb and not any(d.occupants for d in plan.devices.values()):
        # Accepted flags act: with no rank on a GPU there is no device memory to check.
        plan.problems.append("--device-memory-gb: no role of this config uses a GPU (num_gpus_per_worker 0 and no "
                             "device_mapping), so there is no device to check; give the roles GPUs or drop the flag")
    for problem in plan.problems:
        print(f"error: {problem}", file=sys.stderr)
    return not plan.problems


def _host_plan_fits(cfg, args) -> bool:
    """Print the host-memory plan of a CPU run and its problems (GPU runs: nothing)."""
    from roll_gspo.config.plan.model_shape import model_shape, policy_shape
    from roll_gspo.placement.host_memory import plan_host_memory

    if args.host_memory_gb is not None:
        host, source = args.host_memory_gb * (1 << 30), "--host-memory-gb"
    else:
        import psutil

        memory = psutil.virtual_memory()
        host = float(memory.total)
        source = f"this machine; {memory.available / (1 << 30):.1f} GiB available now"
    teachers = {name: model_shape(role.model_args.model_name_or_path or "") for name, role in cfg.teacher_roles().items()}
    plan = plan_host_memory(cfg, policy_shape(cfg), host, source, teachers)
    if plan is None:
        if args.host_memory_gb is not None:
            print("error: --host-memory-gb: a role of this config uses a GPU; the device plan (--device-memory-gb) "
                  "applies", file=sys.stderr)
            return False
        return True
    print(plan.text())
    for problem in plan.problems:
        print(f"error: {problem}", file=sys.stderr)
    return not plan.problems


def _ray_nodes(address: str) -> list:
    import ray

    ray.init(address=address, log_to_driver=False, logging_level=logging.WARNING)
    try:
        return ray.nodes()
    finally:
        ray.shutdown()
