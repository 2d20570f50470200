"""The README and docs/ as a reader meets them: every Python block runs as it stands (under torchrun
where its marker says so, its printed lines equal to the output block after it, if any) or is
marked a fragment; every relative link resolves, to a heading where it names one; every name of
the package and every repository path they mention exists.

A Python block is preceded by a marker: `<!-- fragment -->` (an excerpt, not run), `<!-- run -->`
(run with this interpreter) or `<!-- torchrun N -->` (run under torchrun with N processes).
"""

import importlib
import os
from pathlib import Path
import re
import subprocess
import sys

import pytest

from parity_tests import jobs

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(
    r"(?:<!-- (?P<marker>[^>]*) -->\n)?```python\n(?P<code>.*?)```(?:\n+```\n(?P<output>.*?)```)?", re.S
)
MARKER = re.compile(r"fragment|run|torchrun (\d)")
LINK = re.compile(r"\]\(([^)\s]+)\)")
NAME = re.compile(r"`((?:torch_impl|hf|jax_reference)(?:\.[A-Za-z_]\w*)+)")
PATH = re.compile(
    r"`((?:torch_impl|jax_reference|parity_tests|examples|benchmarks|cp_support|docs)/[\w./-]*\w)"
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
