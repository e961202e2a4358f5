"""The prose a newcomer reads first stays short and true: the schema's help texts (what
docs/config_reference.md renders), the README's length and folder list, and the paths
docs/contributing.md names. Pure file reads; no Ray, no model."""
from __future__ import annotations

import dataclasses
import inspect
import re
import textwrap
from pathlib import Path
from typing import Dict, List, Tuple

import pytest

from roll_gspo.schema import config as schema

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"

# A help text is rendered on one line of the reference; at this width it may fill at most this many.
HELP_WIDTH = 100
HELP_MAX_LINES = 4
README_MAX_LINES = 150

MARKDOWN_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def schema_help_texts() -> Dict[str, str]:
    """`Block.key` -> the help as the reference renders it (whitespace collapsed), for every key of
    every block of the schema."""
    texts = {}
    for name, cls in inspect.getmembers(schema, inspect.isclass):
        if cls.__module__ == schema.__name__ and dataclasses.is_dataclass(cls):
            for field in dataclasses.fields(cls):
                texts[f"{name}.{field.name}"] = " ".join(field.metadata.get("help", "").split())
    return texts


def rendered_lines(text: str) -> int:
    return len(textwrap.wrap(text, HELP_WIDTH))


def heading_anchors(path: Path) -> set:
    """GitHub's anchors of a Markdown file's headings (code blocks skipped)."""
    anchors, in_code = set(), False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        elif not in_code and line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            anchors.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return anchors


def broken_links(text: str, base: Path, page: Path = DOCS / "config_reference.md") -> List[str]:
    """The relative Markdown links in `text` (resolved from folder `base`; an anchor alone names a
    heading of `page`) whose file or heading anchor does not exist."""
    broken = []
    for target in MARKDOWN_LINK.findall(text):
        if re.match(r"[a-z]+:", target):
            continue  # http(s), mailto
        file_part, _, anchor = target.partition("#")
        path = (base / file_part).resolve() if file_part else None
        if path is not None and not path.exists():
            broken.append(target)
        elif anchor and (path or page).suffix == ".md" and anchor not in heading_anchors(path or page):
            broken.append(target)
    return broken


def test_help_texts_fit_in_four_lines():
    texts = schema_help_texts()
    assert len(texts) > 300  # the walk found the schema
    too_long = {key: rendered_lines(text) for key, text in texts.items() if rendered_lines(text) > HELP_MAX_LINES}
    assert not too_long, (f"help texts over {HELP_MAX_LINES} lines of {HELP_WIDTH} characters (say what the key "
                          f"does and its default, link the doc section; rules go in a @check doc): {too_long}")


# Help texts that still state a refusal or a warning, because no registered check holds it: the
# loader's ROLL translation (roll_gspo.config.roll.roll_compat), the start of a run, the engine at
# start, or words about something else (a refused HTTP request, a run-time warning). A new entry
# here is a rule to move into a check's `doc=` instead.
RULES_OUTSIDE_CHECKS = {
    "PipelineConfig.pg_clip", "PipelineConfig.use_pg_clip_range", "PipelineConfig.global_template",
    "PipelineConfig.rollout_correction",  # the loader
    "PipelineConfig.resume_from_checkpoint", "PipelineConfig.difficulty_loss_weight",  # the run's start
    "ModelArgs.adapter_name_or_path", "FSDP2WrapPolicy.transformer_layer_cls_to_wrap",
    "FSDP2WrapPolicy.wrap_lm_output",  # the engine or --dry-run, against the model
    "RewardConfig.judge_max_retries", "RewardConfig.generating_args",  # a refused request; a run-time warning
}
RULE_WORDS = re.compile(r"\brefuse|\bis an error|\bwarns\b|\bmust agree")


def test_help_texts_leave_rules_to_the_checks():
    """A refusal or warning is said once, in its @check's doc (the reference's "Checks beyond types");
    `_refused_unless` keys, ROLL switches accepted only off, say their one refusal themselves."""
    stating = set()
    for name, cls in inspect.getmembers(schema, inspect.isclass):
        if cls.__module__ == schema.__name__ and dataclasses.is_dataclass(cls):
            stating |= {f"{name}.{field.name}" for field in dataclasses.fields(cls)
                        if "refused_unless" not in field.metadata and RULE_WORDS.search(field.metadata.get("help", ""))}
    assert stating - RULES_OUTSIDE_CHECKS == set(), "help texts restating a rule: say it in the check's doc="
    assert RULES_OUTSIDE_CHECKS - stating == set(), "no longer stated: drop them from RULES_OUTSIDE_CHECKS"


def test_help_text_line_count_counts_wrapped_lines():
    assert rendered_lines("word " * 80) == 4
    assert rendered_lines("word " * 81) == 5


def test_help_text_links_resolve():
    """A help text's links are relative to docs/ (where the reference is rendered) and name a real
    heading; an anchor alone is one of the reference's own sections."""
    broken = {key: links for key, text in schema_help_texts().items() if (links := broken_links(text, DOCS))}
    assert not broken, broken


def test_broken_links_finds_a_missing_file_and_a_missing_heading():
    assert broken_links("[a](async.md) [b](async.md#no-such-heading) [c](no_such.md) [d](https://x.y/z)",
                        DOCS) == ["async.md#no-such-heading", "no_such.md"]


def test_stale_async_help_is_gone():
    """Dynamic sampling with k >= 2 is allowed (tests/test_async_dynamic_sampling.py); the help once said
    otherwise. The async rules live in the async check's doc only."""
    help_text = schema_help_texts()["PipelineConfig.async_generation_ratio"]
    assert "dynamic sampling" not in help_text and "refused" not in help_text


# --- README -----------------------------------------------------------------------------------

def readme() -> str:
    return (REPO / "README.md").read_text()


def package_folders(root: Path) -> List[str]:
    return sorted(p.name for p in root.iterdir() if p.is_dir() and (p / "__init__.py").is_file())


def test_readme_is_short():
    lines = readme().splitlines()
    assert len(lines) <= README_MAX_LINES, (f"README.md has {len(lines)} lines (at most {README_MAX_LINES}): "
                                            "results go to docs/benchmarks.md, details to docs/")


def test_readme_names_every_package_folder():
    text = readme()
    folders = package_folders(REPO / "roll_gspo")
    assert "config" in folders and "workers" in folders
    missing = [f"roll_gspo/{name}/" for name in folders if f"`roll_gspo/{name}/`" not in text]
    missing += [] if "`pipelines/`" in text else ["pipelines/"]
    config_line = next((line for line in text.splitlines() if "`roll_gspo/config/`" in line), "")
    missing += [f"roll_gspo/config/{name}/" for name in package_folders(REPO / "roll_gspo" / "config")
                if f"`{name}/`" not in config_line]
    assert not missing, f"README.md's folder list does not name {missing}"


def test_readme_links_resolve():
    assert not broken_links(readme(), REPO, REPO / "README.md")


def test_readme_figures_name_their_command():
    """Each headline figure's row ends in the command (or the file) that printed it."""
    rows = [line for line in readme().splitlines() if line.startswith("| ") and not line.startswith("| ---")]
    assert rows and len(rows) - 1 <= 8, "at most ~8 headline figures; the ledger is docs/benchmarks.md"
    for row in rows[1:]:
        last_cell = row.strip().strip("|").split("|")[-1]
        assert "`" in last_cell or "](" in last_cell, f"a figure without its command: {row}"


# --- docs/contributing.md ---------------------------------------------------------------------

def named_paths(text: str) -> List[Tuple[str, Path]]:
    """The repository paths a Markdown text names in backticks: anything with a `/` or ending in
    `.py`, and dotted `roll_gspo.` / `pipelines.` module names (placeholders with `<` skipped)."""
    found = []
    for token in re.findall(r"`([^`\s]+)`", text):
        token = token.split("::")[0].rstrip(",.")
        if "<" in token or token.startswith(("-", "http")) or "=" in token:
            continue
        if re.fullmatch(r"(roll_gspo|pipelines)(\.\w+)+", token):
            module = REPO / token.replace(".", "/")
            found.append((token, module if module.is_dir() else module.with_suffix(".py")))
        elif "/" in token or token.endswith(".py"):
            found.append((token, REPO / token))
    return found


def test_contributing_names_only_real_paths():
    text = (DOCS / "contributing.md").read_text()
    paths = named_paths(text)
    assert len(paths) > 20  # the guide names its files in full
    missing = [token for token, path in paths if not path.exists()]
    assert not missing, f"docs/contributing.md names paths that do not exist: {missing}"
    assert not broken_links(text, DOCS, DOCS / "contributing.md")


@pytest.mark.parametrize("row", ["a rollout engine", "a training backend", "a weight-sync transport", "a tracker",
                                 "an advantage estimator", "a config check"])
def test_contributing_has_a_row_for(row):
    assert f"| **{row}** |" in (DOCS / "contributing.md").read_text()


def test_named_paths_reads_files_folders_and_modules():
    found = dict(named_paths("`roll_gspo/sync/` `tests/test_docs.py` `roll_gspo.catalog.estimators` "
                             "`bench_<what>.py` `a=b/c`"))
    assert set(found) == {"roll_gspo/sync/", "tests/test_docs.py", "roll_gspo.catalog.estimators"}
    assert all(path.exists() for path in found.values())
