"""roll_gspo.utils.imports: a module imported without one of its optional imports (DeepSpeed's
autotuner without mlflow, in every rank: tests/test_cluster.py checks the ranks install it)."""
import importlib
import importlib.util
import sys

import pytest

from roll_gspo.utils.imports import DEEPSPEED_WITHOUT_MLFLOW, _WithoutWhileLoading


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
