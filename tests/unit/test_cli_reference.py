"""The spec reference and the `dstune init` example are generated from the field descriptions and stay in sync."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st
from pydantic import BaseModel

from dstune.reference import example_spec, family_models, reference_markdown, yaml_value
from dstune.spec.load import SpecSource, validate_data
from dstune.spec.models import Spec

REPO = Path(__file__).resolve().parents[2]


def all_keys(model: type[BaseModel], prefix: str) -> list[str]:
    keys = []
    for name, info in model.model_fields.items():
        keys.append(f"{prefix}.{name}")
        annotation = info.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            keys += all_keys(annotation, f"{prefix}.{name}")
    return keys


def every_spec_key() -> list[str]:
    keys = []
    for name, info in Spec.model_fields.items():
        section = family_models()["sd"] if name == "model" else info.annotation
        keys += [name] + all_keys(section, name)
    return keys


def test_docs_spec_reference_is_regenerated():
    committed = (REPO / "docs" / "spec-reference.md").read_text()
    assert committed == reference_markdown(), "docs/spec-reference.md is stale: run `make docs`"


def test_reference_documents_every_key_with_its_description():
    text = reference_markdown()
    for key in every_spec_key():
        if "." in key:
            assert f"| `{key}` |" in text, key
    assert "Samples per forward pass on each GPU." in text


def test_init_example_names_every_key_and_parses_to_the_spec_it_shows():
    text = example_spec("sd")
    data = yaml.safe_load(text)
    spec = validate_data(data, SpecSource("init.yaml"))
    assert spec.model.pretrained == "builtin:tiny-sd" and spec.data.path == "builtin:shapes"
    for key in every_spec_key():
        name = key.rsplit(".", 1)[-1]
        assert f"{name}:" in text, key  # written out, or commented out with a typical value
    uncommented = "\n".join(line.split("#", 1)[0] for line in text.splitlines())
    assert yaml.safe_load(uncommented) == data


def test_init_rejects_an_unknown_family():
    with pytest.raises(ValueError, match="unknown family"):
        example_spec("sdxl-nope")


@given(
    st.one_of(
        st.floats(allow_nan=False, allow_infinity=False),
        st.integers(),
        st.booleans(),
        st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs", "Cc"))),
        st.lists(st.floats(allow_nan=False, allow_infinity=False, width=32), max_size=3),
    )
)
def test_yaml_value_reads_back_as_the_same_value_before_a_comment(value):
    """1e-05 must not become the string '1e-05' (YAML 1.1), nor 'a # b' lose its tail to the comment."""
    back = yaml.safe_load(f"key: {yaml_value(value)}  # the description")["key"]
    assert back == value


def test_batches_page_shows_the_current_demo_output(capsys, monkeypatch):
    """docs/batches-and-epochs.md pastes `dstune validate` of the demo; the demo or the output format changed if
    this fails: paste the new output."""
    from dstune.cli import main

    monkeypatch.setenv("COLUMNS", "80")  # the width the page was pasted at (rich's default off a terminal)
    assert main(["validate", str(REPO / "launch" / "sd-tiny-demo.yaml"), "--num-gpus", "2"]) == 0
    lines = [line.rstrip() for line in capsys.readouterr().out.splitlines()][1:]  # the title names the path
    page = (REPO / "docs" / "batches-and-epochs.md").read_text()
    assert "\n".join(lines) in page
