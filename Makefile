# The README's two commands: `make run` (the main GSPO job) and `make test` (the test suite).
PY := .venv/bin/python
export VLLM_ENABLE_V1_MULTIPROCESSING ?= 0
export TORCH_COMPILE_DISABLE ?= 1
export VLLM_CPU_KVCACHE_SPACE ?= 1

.PHONY: install lint typecheck run test test-fast benchmark clean docker-cpu docker-gpu

install:
	@bash scripts/install.sh

# Extra Hydra overrides: make run ARGS="max_steps=100 resume_from_checkpoint=auto"
run: install
	$(PY) run_pipeline.py --config example_gspo.yaml $(ARGS)

# ruff first: a second, before any test starts (ruff.toml says what it checks).
lint:
	$(PY) -m ruff check

# mypy over the packages mypy.ini names (config, placement, schema, algorithms, serving): seconds, after ruff, before any test.
typecheck:
	$(PY) -m mypy

test: install lint typecheck
	PY=$(PY) bash scripts/run_tests.sh

test-fast: install lint typecheck
	$(PY) -m pytest tests -q -m "not e2e"

benchmark: install
	$(PY) benchmarks/bench_pipeline.py

# Images (docker/README.md): make docker-cpu DOCKER_ARGS="--build-arg TORCH_FIND_LINKS=..."
docker-cpu:
	docker build -f docker/Dockerfile.cpu -t roll-gspo:cpu $(DOCKER_ARGS) .

docker-gpu:
	docker build -f docker/Dockerfile -t roll-gspo:gpu $(DOCKER_ARGS) .

clean:
	rm -rf output .pytest_cache
