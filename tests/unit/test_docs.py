"""The user docs stay in step with the code: the README names every model and every example spec, the spec
reference states each family's own defaults, and no page leans on notes that are not in the repository."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from dstune.builtin import BUILTIN_MODELS
from dstune.reference import family_models, reference_markdown
from dstune.spec.models import FAMILIES
from dstune import registry

REPO = Path(__file__).resolve().parents[2]
README = (REPO / "README.md").read_text()


def readme_section(title: str) -> str:
    """The text of README's `## title` section, up to the next `## ` heading."""
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", README, re.S | re.M)
    assert match, f"README.md has no '## {title}' section"
    return match.group(1)


def test_readme_names_every_model_family_init_name_and_builtin():
    models = readme_section("Models")
    rows = [line for line in models.splitlines() if line.startswith("| ") and "`" in line]
    missing = [f"model.family `{family}`" for family in FAMILIES if f"| `{family}` |" not in models]
    missing += [f"`builtin:{name}`" for name in BUILTIN_MODELS if f"`builtin:{name}`" not in models]
    missing += [
        f"init --model `{p.name}` (builtin:{p.builtin})"
        for p in registry.presets()
        if not any(
            f"| `{p.name}` |" in row and f"`builtin:{p.builtin}`" in row and f"| `{p.family}` |" in row for row in rows
        )
    ]
    assert not missing, "README.md's model table lacks: " + ", ".join(missing)


def test_readme_lists_every_example_spec_and_only_existing_ones():
    examples = readme_section("Example specs (`launch/`)")
    named = set(re.findall(r"`(launch/[^`]+\.yaml)`", examples))
    on_disk = {f"launch/{path.name}" for path in (REPO / "launch").glob("*.yaml")}
    assert not on_disk - named, f"README.md's example list lacks {sorted(on_disk - named)}"
    assert not named - on_disk, f"README.md lists examples that do not exist: {sorted(named - on_disk)}"


def lora_target_default_in_reference(family: str) -> str:
    """The Default cell of `model.lora.target_modules` in the `model.lora` section after family's `model` section."""
    text = reference_markdown()
    start = text.index(f"## `model` (family `{family}`)")
    lora = text.index("## `model.lora`", start)
    row = next(line for line in text[lora:].splitlines() if line.startswith("| `model.lora.target_modules` |"))
    return row.split(" | ")[2]


@pytest.mark.parametrize("family", [f for f, model in family_models().items() if "lora" in model.model_fields])
def test_spec_reference_gives_each_familys_own_lora_targets(family):
    section = family_models()[family]
    parsed = section.model_validate({"family": family, "train": "lora", "lora": {"rank": 4}})
    expected = "`[" + ", ".join(parsed.lora.target_modules) + "]`"
    assert lora_target_default_in_reference(family) == expected


# Notes the repository does not hold, and wording that points at them instead of stating the fact.
OUTSIDE_REFERENCES = re.compile(
    r"FIELD_NOTES|DESIGN\.md|\bissues? #?\d+|the issue\b|another branch|\bengineers?\b"
    r"|#\d{3,}|\bsession\b",
    re.I,
)


def test_user_docs_do_not_cite_notes_outside_the_repository():
    pages = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    found = [
        f"{page.relative_to(REPO)}:{number}: {line.strip()}"
        for page in pages
        for number, line in enumerate(page.read_text().splitlines(), 1)
        if OUTSIDE_REFERENCES.search(line)
    ]
    assert not found, "rewrite as self-contained statements:\n" + "\n".join(found)


CODE_OUTSIDE_REFERENCES = re.compile(r"FIELD_NOTES|DESIGN\.md|shared/recipes|shared/reviews|\bissue \d+", re.I)


def test_code_comments_do_not_cite_notes_outside_the_repository():
    """A reader of dstune/ (or of the tests and benchmarks) has the repository, not the team's notes: a comment
    states its reason instead of pointing at them."""
    files = [path for folder in ("dstune", "tests", "bench") for path in sorted((REPO / folder).rglob("*.py"))]
    found = [
        f"{path.relative_to(REPO)}:{number}: {line.strip()}"
        for path in files
        if path != Path(__file__)
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if CODE_OUTSIDE_REFERENCES.search(line)
    ]
    assert not found, "state the reason in the comment:\n" + "\n".join(found)


# ------------------------------------------------------------------------------ user pages and developer notes

# The developers' section: docs/dev/, and the two developer pages at the top of docs/ (the map of the code and how
# it is tested). Every other page, and the README, is written for users.
DEVELOPER_PAGES = {"architecture.md", "testing.md"}
# The module files of the package (a page may name dstune/train.py only as the checkout form, below).
MODULE_FILES = {path.name for path in (REPO / "dstune").rglob("*.py")} - {"__init__.py", "__main__.py", "train.py"}
MODULE_REFERENCE = re.compile(
    r"dstune/(?!train\.py)[A-Za-z_]+"  # a path into the package
    r"|\bdstune\.(?!train\b)[a-z_]+"  # a dotted module name (`python -m dstune.train` is how users launch)
    r"|\btests/|\btest_[a-z0-9_]+\.py"  # a test file
    r"|\b(?:" + "|".join(re.escape(name) for name in sorted(MODULE_FILES)) + r")\b"  # a module file by its name
)
CHECKOUT_FORM = re.compile(r"deepspeed\b.*\bdstune/train\.py")


def user_pages() -> list[Path]:
    return [REPO / "README.md"] + [
        page for page in sorted((REPO / "docs").glob("*.md")) if page.name not in DEVELOPER_PAGES
    ]


def test_user_pages_name_no_module_path_or_test_file():
    """Users are told what to do and why; where the code lives and how it is tested is in docs/dev/."""
    found = [
        f"{page.relative_to(REPO)}:{number}: {match.group(0)!r} in {line.strip()[:100]}"
        for page in user_pages()
        for number, line in enumerate(page.read_text().splitlines(), 1)
        for match in [MODULE_REFERENCE.search(line)]
        if match
    ]
    assert not found, "move to docs/dev/ or say it in a user's words:\n" + "\n".join(found)


def test_every_launch_from_a_checkout_says_so():
    """`deepspeed ... dstune/train.py` runs only in a checkout of dstune: each such line says so; `dstune train` and
    `deepspeed --module dstune.train` work from any folder."""
    pages = [*user_pages(), *sorted((REPO / "docs" / "dev").glob("*.md")), *(REPO / "launch").glob("*")]
    unlabelled = [
        f"{page.relative_to(REPO)}:{number}: {line.strip()}"
        for page in pages
        if page.is_file()
        for number, line in enumerate(page.read_text().splitlines(), 1)
        if CHECKOUT_FORM.search(line) and "checkout" not in line
    ]
    assert not unlabelled, "label each as the checkout form (e.g. '# from a checkout of dstune'):\n" + "\n".join(
        unlabelled
    )


def test_the_scans_find_what_they_look_for():
    """The two rules above on lines they must catch and lines they must let pass."""
    for line in (
        "`dstune/families/flow_model.py` is the core",
        "see dstune.data.groups.speaker_balanced_order",
        "`tests/unit/test_ltx2.py` checks it",
        "the unit's `card.py`",
        "test_family_flow.py re-computes",
    ):
        assert MODULE_REFERENCE.search(line), line
    for line in (
        "deepspeed --num_gpus 8 --module dstune.train spec.yaml",
        "python -m dstune.train spec.yaml",
        "diffusers' `train_dreambooth_lora_flux2_klein.py`",
        "data.path: /data/my-images",
    ):
        assert not MODULE_REFERENCE.search(line), line
    assert CHECKOUT_FORM.search("deepspeed --num_gpus 8 dstune/train.py spec.yaml")
    assert not CHECKOUT_FORM.search("deepspeed --num_gpus 8 --module dstune.train spec.yaml")
