"""The documentation that is checked against the code: the configuration reference, the
module map, the links between pages, and the README's first screen."""

import dataclasses
import pathlib
import re

import pytest

from flaxformer_lite.config import reference as config_docs

ROOT = pathlib.Path(__file__).resolve().parents[3]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_configuration_reference_is_generated_from_the_dataclasses():
    page = config_docs.DOC.read_text()
    assert config_docs.render(page) == page, (
        "docs/configuration.md differs from the dataclasses: run "
        "`python -m flaxformer_lite.config.reference --write`"
    )


def test_reference_lists_every_field_of_every_section():
    text = config_docs.reference()
    for name, cls, _ in config_docs.sections():
        assert f"### `{name}`" in text
        for f in dataclasses.fields(cls):
            assert f"`{f.name}`" in text, (name, f.name)


def test_reference_shows_default_values_and_the_checks_words():
    from configs import default

    config = default.get_config()
    rows = {
        line.split("|")[1].strip(): line
        for line in config_docs.reference().splitlines()
        if line.startswith("| `")
    }
    assert f"`{config.model.d_model}`" in rows["`d_model`"].split("|")[3]
    assert f"`{config.train.num_steps}`" in rows["`num_steps`"].split("|")[3]
    assert "a positive integer" in rows["`num_steps`"]


def test_render_replaces_only_the_generated_block():
    page = f"intro\n\n{config_docs.BEGIN}\n\nstale\n{config_docs.END}\n\nafter\n"
    out = config_docs.render(page)
    assert out.startswith("intro\n\n") and out.endswith(f"{config_docs.END}\n\nafter\n")
    assert "stale" not in out and "### `model`" in out


def _module_map() -> set[str]:
    text = (ROOT / "docs" / "architecture.md").read_text()
    block = text.split("## Module map", 1)[1]
    return set(re.findall(r"^\| `([\w/]+\.py)` \|", block, re.M))


def test_module_map_names_every_module_of_the_package():
    package = ROOT / "flaxformer_lite"
    modules = {
        p.relative_to(package).as_posix()
        for p in package.rglob("*.py")
        if p.name != "__init__.py" and "__pycache__" not in p.parts
    }
    listed = _module_map()
    assert modules - listed == set(), "modules missing from docs/architecture.md's module map"
    assert listed - modules == set(), (
        "docs/architecture.md's module map names modules that are gone"
    )


def _slug(heading: str) -> str:
    heading = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return heading.replace(" ", "-")


def _anchors(path: pathlib.Path) -> set[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    return {_slug(m.group(1)) for m in re.finditer(r"^#+\s+(.*)$", text, re.M)}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_relative_links_reach_a_file_and_a_heading(page):
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
        if re.match(r"[a-z]+://", target):
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists() or (file.suffix == ".md" and anchor not in _anchors(file) | {""}):
            broken.append(target)
    assert broken == []


def test_slug_follows_the_renderers_rule():
    assert _slug("Copy head (pointer-generator)") == "copy-head-pointer-generator"
    assert _slug("Benchmarks: `bench.py`") == "benchmarks-benchpy"


def test_readme_is_short_and_starts_with_the_two_commands():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 100
    block = lines[lines.index("```bash") + 1 : lines.index("```")]
    assert lines.index("```bash") < 5
    assert [line.split("#")[0].strip() for line in block] == [
        "pip install -e . && python train.py",
        'pip install -e ".[dev]" && python -m pytest -q',
    ]
