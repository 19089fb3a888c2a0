"""The documentation site: it builds with ``mkdocs build --strict`` (no broken link, no unresolved reference,
every page in the nav), every public name has a docstring, and the generated pages (config reference,
Measured, API) are what ``python -m experiments.docs_gen`` writes from the code today. The pages' Python
blocks and commands are ``tests/test_readme.py``'s. About 30 s on 2 cores, most of it the build.
"""

import json
import os
import re
import subprocess
import sys

import pytest

from experiments import bench_record, docs_api, docs_gen
from tests.conftest import REPO_ROOT

README_LIMIT_BYTES = 15_000


def test_generated_pages_are_current():
    assert docs_gen.stale_pages(docs_gen.pages()) == [], "run python -m experiments.docs_gen"


def test_the_config_reference_lists_every_field_with_its_check():
    page = docs_gen.config_page()
    for launcher, (_, fields) in docs_gen.LAUNCHERS.items():
        assert f"## {launcher}" in page
        for name in fields():
            assert f"| `{name}` | " in page, name
    assert "| `stages[i].steps` | `1` | must be a positive integer |" in page
    assert "## demo" in page and "| `task.num_train` | `2400` |" in page


def test_every_public_name_has_a_docstring():
    assert docs_api.undocumented() == []


def test_a_comment_above_a_constant_is_its_docstring(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text(
        '#: first line\n#: second line\nDOCUMENTED = 1\n# a plain comment\nPLAIN = 2\n', encoding="utf-8")
    import griffe

    loader = griffe.GriffeLoader(search_paths=[str(tmp_path)],
                                 extensions=griffe.load_extensions(docs_api.CommentDocstrings))
    package = loader.load("pkg")
    assert package["DOCUMENTED"].docstring.value == "first line\nsecond line"
    assert package["PLAIN"].docstring is None


def test_measured_page_renders_every_record():
    page = docs_gen.measured_page()
    records = sorted(docs_gen.RESULTS.glob("*.json"))
    assert records
    for path in records:
        record = json.loads(path.read_text(encoding="utf-8"))
        assert {"command", "commit", "date", "machine", "load", "figures"} <= set(record), path.name
        assert f"## {path.stem}\n" in page and f"`{record['command']}`" in page
        transcribed = record["commit"].startswith("not recorded")
        assert transcribed == ("source" in record), f"{path.name}: a transcribed record says where from"


def test_readme_is_a_front_page():
    readme = (REPO_ROOT / "README.md").read_text(encoding="utf-8")
    assert len(readme.encode("utf-8")) <= README_LIMIT_BYTES
    assert "Main job:\n\n```\nbash .ci/main\n```\n" in readme
    assert "Tests:\n\n```\nbash .ci/test\n```\n" in readme
    linked = set(re.findall(r"\(docs/results/([\w.]+\.json)\)", readme))
    assert linked and all((docs_gen.RESULTS / name).is_file() for name in linked)


def test_bench_record_writes_the_last_json_line(tmp_path, monkeypatch, capsys):
    def main(argv):
        print("| a table |")
        print(json.dumps({"speedup": 2.5}))
        print("a note after the figures")

    monkeypatch.setattr(sys, "argv", ["experiments/bench_x.py", "--steps=2", f"--out={tmp_path}/r.json"])
    bench_record.record_run(main, ["bench_x"], str(tmp_path / "r.json"))
    record = json.loads((tmp_path / "r.json").read_text(encoding="utf-8"))
    assert record["command"] == f"python -m experiments.bench_x --steps=2 --out={tmp_path}/r.json"
    assert record["figures"] == {"speedup": 2.5}
    assert set(record["load"]) == {"before", "after"} and record["machine"]["cores"] == os.cpu_count()
    assert record["commit"] != "unknown" and record["date"].endswith("Z")
    assert "| a table |" in capsys.readouterr().out  # the output still reaches the terminal


def test_bench_record_without_figures_is_an_error(tmp_path):
    with pytest.raises(SystemExit, match="printed no last-line JSON"):
        bench_record.record_run(lambda argv: print("no figures"), ["bench_x"], str(tmp_path / "r.json"))
    assert not (tmp_path / "r.json").exists()


def test_site_builds_strict(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "NO_MKDOCS_2_WARNING": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    warnings = [line for line in done.stderr.splitlines() if "WARNING" in line or "ERROR" in line]
    assert done.returncode == 0, "\n".join(warnings) or done.stderr[-3000:]
    api = (tmp_path / "site" / "api" / "engine" / "index.html").read_text(encoding="utf-8")
    assert 'id="rstar2jax.engine.state.BUDGET"' in api  # a constant, documented by its #: comment
