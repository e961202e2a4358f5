"""roll_gspo.utils.imports: a module imported without one of its optional imports (DeepSpeed's
autotuner without mlflow, transformers' candidate generator without scikit-learn, in every rank:
tests/test_cluster.py checks the ranks install them)."""
import importlib
import importlib.util
import sys

import pytest

from roll_gspo.utils.imports import (DEEPSPEED_WITHOUT_MLFLOW, TRANSFORMERS_WITHOUT, VLLM_WITHOUT_SCIPY_SIGNAL,
                                     _WithoutWhileLoading)


@pytest.fixture
def fake_package(tmp_path, monkeypatch):
    """fakepkg.tuner tries `import fakeoptional` as DeepSpeed's autotuner tries mlflow."""
    (tmp_path / "fakepkg").mkdir()
    (tmp_path / "fakepkg" / "__init__.py").write_text("")
    (tmp_path / "fakepkg" / "tuner.py").write_text(
        "try:\n    import fakeoptional\n    has_optional = True\nexcept Exception:\n    has_optional = False\n")
    (tmp_path / "fakeoptional.py").write_text("VALUE = 7\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    finder = _WithoutWhileLoading("fakepkg.tuner", "fakeoptional")
    sys.meta_path.insert(0, finder)
    yield
    sys.meta_path.remove(finder)
    for name in ("fakepkg", "fakepkg.tuner", "fakeoptional"):
        sys.modules.pop(name, None)


def test_the_blocked_module_is_left_out_only_while_the_target_loads(fake_package):
    tuner = importlib.import_module("fakepkg.tuner")
    assert tuner.has_optional is False and "fakeoptional" not in sys.modules
    assert importlib.import_module("fakeoptional").VALUE == 7  # afterwards it imports as usual


def test_an_already_imported_module_is_left_alone(fake_package):
    importlib.import_module("fakeoptional")
    assert importlib.import_module("fakepkg.tuner").has_optional is True


def test_deepspeed_autotuner_still_tries_mlflow():
    """The hook names DeepSpeed's module: if a DeepSpeed upgrade moves the import, this says so
    (the ranks would pay mlflow's import again, ~3 s of CPU each)."""
    target, blocked = DEEPSPEED_WITHOUT_MLFLOW
    spec = importlib.util.find_spec(target)
    assert spec is not None and f"import {blocked}" in spec.loader.get_source(target)
    assert spec.loader.is_package(target) is False  # the wrapped loader answers as the file's own


def test_vllm_audio_still_guards_its_scipy_import():
    """The hook leaves scipy.signal out while vLLM's audio helpers load (every rank's start-up): if a
    vLLM upgrade stops guarding the import, vLLM would fail to import in the ranks; this says so first."""
    target, blocked = VLLM_WITHOUT_SCIPY_SIGNAL
    source = importlib.util.find_spec(target).loader.get_source(target)
    guarded = source.split(f"import {blocked}")[0].rsplit("\n", 2)[-2].strip()
    assert guarded == "try:" and "except ImportError:" in source.split(f"import {blocked}")[1].split("\n")[1], guarded


@pytest.mark.parametrize("module,package", sorted(TRANSFORMERS_WITHOUT.items()))
def test_transformers_modules_still_ask_for_their_optional_package(module, package):
    """The hook swaps `transformers.utils.is_<package>_available` while the module loads: if a
    transformers upgrade moves the import or the check, this says so."""
    sources = [importlib.util.find_spec(module).loader.get_source(module)]
    if module == "transformers.loss.loss_utils":  # the detection losses it imports ask for scipy
        sources.append(importlib.util.find_spec("transformers.loss.loss_for_object_detection").loader.get_source(
            "transformers.loss.loss_for_object_detection"))
        assert "loss_for_object_detection import" in sources[0]
    assert f"is_{package}_available()" in sources[-1] and f"from {package}" in sources[-1]
    assert "from ..utils import" in sources[-1]  # the name is read from transformers.utils at import time


def test_transformers_loads_without_sklearn_and_generates(tmp_path):
    """In a fresh process with the hooks (as a rank): the auto classes and generate() work and
    neither scikit-learn nor scipy is imported."""
    import subprocess

    # min_new_tokens: the untrained model may pick its EOS token (2) first, which ended generate() early
    code = ("import sys\n"
            "from roll_gspo.utils.imports import lighter_imports\n"
            "lighter_imports()\n"
            "import torch\n"
            "from transformers import AutoModelForCausalLM, LlamaConfig\n"
            "from transformers.generation import candidate_generator\n"
            "config = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,\n"
            "                     num_attention_heads=2, num_key_value_heads=2)\n"
            "model = AutoModelForCausalLM.from_config(config)\n"
            "out = model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=3, min_new_tokens=3, do_sample=False)\n"
            "assert out.shape == (1, 6), out.shape\n"
            "assert 'sklearn' not in sys.modules and 'scipy' not in sys.modules, sorted(sys.modules)\n"
            "assert candidate_generator.is_sklearn_available() is False\n"
            "print('ok')\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-2000:]
    import transformers.utils

    if importlib.util.find_spec("sklearn") is not None:  # the hook restored the real answer here too
        assert transformers.utils.is_sklearn_available() is True
