"""The generated config reference (docs/config_reference.md): every schema key has help, the
reference documents each with its type, default and choices, and the committed file is in sync."""
from roll_gspo.config.load.config_reference import main as reference_main
from roll_gspo.config.load.config_reference import render_reference
from roll_gspo.schema.config import PipelineConfig
from tests.config_helpers import REPO, schema_fields


# --------------------------------------------------------------------------------------------
# The generated reference
# --------------------------------------------------------------------------------------------
def test_every_schema_field_has_help():
    fields = schema_fields(PipelineConfig)
    assert len(fields) > 100
    missing = [path for path, field in fields if not field.metadata.get("help", "").strip()]
    assert missing == []


def test_reference_documents_every_key_with_type_default_choices_help():
    text = render_reference()
    lines = {line.split("`")[1]: line for line in text.splitlines() if line.startswith("- **`")}
    for path, field in schema_fields(PipelineConfig):
        if path in lines:
            line = lines[path]
            assert " ".join(field.metadata["help"].split()) in line, path
            for choice in field.metadata.get("choices", []):
                assert ("`null`" if choice is None else f'`"{choice}"`') in line, (path, choice)
        else:  # a block: documented as a section heading
            assert f"`{path}`" in text, path
    assert '**`actor_infer.strategy_args.strategy_name`** (str; default `"vllm"`' in text
    assert '**`actor_train.strategy_args.strategy_name`** (str; default `"deepspeed_train"`' in text
    assert "**`validation.generating_args.temperature`** (float; default `0.0`)" in text
    assert "**`reward_norm`** (str or null; default `null`; one of `null`" in text
    assert "**`rewards.<domain>.worker_cls`**" in text


def test_docs_config_reference_is_in_sync():
    path = REPO / "docs" / "config_reference.md"
    assert path.is_file(), "run `python -m roll_gspo.config.load.config_reference --write`"
    assert path.read_text() == render_reference(), "run `python -m roll_gspo.config.load.config_reference --write`"


def test_reference_module_prints_and_checks(capsys):
    assert reference_main([]) == 0
    assert capsys.readouterr().out == render_reference()
    assert reference_main(["--check"]) == 0
