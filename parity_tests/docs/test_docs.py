"""The README and docs/ as a reader meets them: every Python block runs as it stands (under torchrun
where its marker says so, its printed lines equal to the output block after it, if any) or is
marked a fragment; every relative link resolves, to a heading where it names one; every name of
the package and every repository path they mention exists.

A Python block is preceded by a marker: `<!-- fragment -->` (an excerpt, not run), `<!-- run -->`
(run with this interpreter) or `<!-- torchrun N -->` (run under torchrun with N processes).
"""

import importlib
import json
import os
from pathlib import Path
import re
import subprocess
import sys

import pytest

from parity_tests.harness import jobs

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md"))]
REPORTED = [
    ROOT / "README.md",
    *sorted((ROOT / "docs").glob("*.md")),
]  # the pages benchmarks/report.py writes
RESULTS = ROOT / "docs" / "results"
BLOCK = re.compile(
    r"(?:<!-- (?P<marker>[^>]*) -->\n)?```python\n(?P<code>.*?)```(?:\n+```\n(?P<output>.*?)```)?", re.S
)
MARKER = re.compile(r"fragment|run|torchrun (\d)")
LINK = re.compile(r"\]\(([^)\s]+)\)")
NAME = re.compile(r"`((?:torch_impl|hf|jax_reference)(?:\.[A-Za-z_]\w*)+)")
PATH = re.compile(
    r"`((?:torch_impl|jax_reference|parity_tests|examples|benchmarks|cp_support|tools|docs)/[\w./-]*\w)"
)


def blocks():
    for doc in DOCS:
        for i, match in enumerate(BLOCK.finditer(doc.read_text())):
            yield pytest.param(match, id=f"{doc.name}-{i}")


def runnable():
    for param in blocks():
        marker = param.values[0]["marker"]
        if marker != "fragment" and MARKER.fullmatch(marker or ""):
            yield param


@pytest.mark.parametrize("block", list(blocks()))
def test_every_python_block_is_run_or_marked_a_fragment(block):
    assert MARKER.fullmatch(block["marker"] or ""), f"a Python block without a marker:\n{block['code'][:300]}"


@pytest.mark.parametrize("block", list(runnable()))
def test_the_runnable_blocks_run_as_they_stand(block, tmp_path):
    script = tmp_path / "block.py"
    script.write_text(block["code"])
    nproc = MARKER.fullmatch(block["marker"])[1]
    command = [sys.executable, str(script)]
    if nproc:
        # --tee 3: each rank's lines through torchrun, whole, prefixed "[default<rank>]:"
        command = [jobs.TORCHRUN, "--standalone", "--tee", "3", "--nproc-per-node", nproc, str(script)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=jobs.LAUNCH_TIMEOUT_S
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    if block["output"] is not None:  # its lines, in any order (ranks print concurrently)
        lines = (re.sub(r"^\[default\d+\]:", "", line) for line in done.stdout.splitlines())
        printed = sorted(line for line in lines if line.strip())
        assert printed == sorted(line for line in block["output"].splitlines() if line.strip())


def _slug(heading):
    """GitHub's anchor for a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(doc):
    return {_slug(line.lstrip("#")) for line in doc.read_text().splitlines() if line.startswith("#")}


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: d.name)
def test_every_relative_link_resolves(doc):
    for target in LINK.findall(doc.read_text()):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        linked = (doc.parent / path).resolve() if path else doc
        assert linked.exists(), f"{doc.name}: broken link {target}"
        if anchor and linked.suffix == ".md":
            assert anchor in _anchors(linked), f"{doc.name}: no heading #{anchor} in {linked.name}"


@pytest.mark.parametrize("doc", [d for d in DOCS if d.name != "CHANGELOG.md"], ids=lambda d: d.name)
def test_every_name_and_path_mentioned_exists(doc):
    """(The changelog names what was removed too.)"""
    text = doc.read_text()
    for name in sorted(set(NAME.findall(text))):
        if name.endswith((".md", ".py", ".png")):  # a file, such as `hf.md`
            continue
        parts = name.split(".")
        if parts[0] == "hf":
            parts = ["torch_impl", *parts]
        for split in range(len(parts), 0, -1):  # the longest importable module, then attributes
            try:
                obj = importlib.import_module(".".join(parts[:split]))
                break
            except ImportError:
                continue
        for attribute in parts[split:]:
            assert hasattr(obj, attribute), f"{doc.name}: `{name}` does not exist"
            obj = getattr(obj, attribute)
    for path in sorted(set(PATH.findall(text))):
        assert (ROOT / path).exists(), f"{doc.name}: `{path}` does not exist"


# --- figures: generated from the benchmarks' results, never typed ---------------------------------

GENERATED = re.compile(r"<!-- generated: (\w+) -->\n.*?<!-- end generated -->", re.S)
FIGURE = re.compile(r"\b\d+\.\d+x\b|\b\d[\d,.]* ?(?:ms|MiB|MB|GB|s a step)\b|\b\d+(?:\.\d+)?%")
# figures outside generated blocks that are not measurements: targets, bounds, arithmetic
NOT_MEASURED = {
    ("benchmarks.md", "1.3x"): "make gpu-check's memory target",
    ("benchmarks.md", "20 s a step"): "make gpu-check's time target",
    ("hf.md", "14.7 MB"): "the state's size: 7 x 16 x 128 x 256 float32",
    ("hf.md", "0.56x"): "the attention share's ideal under head_tail, by counting",
    ("testing.md", "8 MiB"): "the long-run test's bound",
}


def test_every_figure_is_generated_from_the_benchmark_results():
    """Every generated block equals what benchmarks/report.py renders from docs/results/ now, each
    results file feeds a block and each block is shown (`python -m benchmarks.report --check`): run
    `make bench-report` after a benchmark, and commit its JSON with the docs."""
    command = [sys.executable, "-m", "benchmarks.report", "--check"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"run `make bench-report`: {done.stdout[-2000:]}{done.stderr[-2000:]}"


def test_every_results_file_is_stamped():
    """Each results file names the commit it was measured at, with no uncommitted change to the code."""
    for path in sorted(RESULTS.glob("*.json")):
        stamp = json.loads(path.read_text())["stamp"]
        assert stamp["commit"] and not stamp["modified"], (path.name, stamp)
        if (ROOT / ".git").exists():
            # an ancestor of HEAD, not merely an object here: a squashed-away commit lingers in this
            # clone's objects but not in CI's clone
            known = subprocess.run(["git", "merge-base", "--is-ancestor", stamp["commit"], "HEAD"], cwd=ROOT)
            assert known.returncode == 0, f"{path.name}: commit {stamp['commit']} is not in HEAD's history"


@pytest.mark.parametrize("doc", REPORTED, ids=lambda d: d.name)
def test_no_measured_figure_outside_a_generated_block(doc):
    text = re.sub(r"```.*?```", "", GENERATED.sub("", doc.read_text()), flags=re.S)
    typed = [m for m in FIGURE.findall(text) if (doc.name, m) not in NOT_MEASURED]
    assert not typed, f"{doc.name}: figures typed by hand (generate them: benchmarks/report.py): {typed}"


def test_the_design_names_every_module():
    """docs/design.md's layout of the repository names every module of the package, the reference,
    the shared support, the examples, the benchmarks and the tools (`name.py`, or `name` in a list of a
    folder's modules); a package's `__init__` and `__main__` by its folder."""
    text = (ROOT / "docs" / "design.md").read_text()
    missing = [
        path.relative_to(ROOT).as_posix()
        for folder in ("torch_impl", "jax_reference", "cp_support", "examples", "benchmarks", "tools")
        for path in sorted((ROOT / folder).rglob("*.py"))
        if path.stem not in ("__init__", "__main__")
        and f"`{path.name}`" not in text
        and f"`{path.stem}`" not in text
    ]
    assert not missing, f"docs/design.md does not name: {missing}"
