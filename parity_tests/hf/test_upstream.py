"""torch_impl.hf.upstream: what the adapter restates of transformers is tied to the release
it restates. Each recorded source is the installed (pinned) release's; a source that a release
changed (here: `inspect.getsource` patched for that one function) is refused naming the
restatement, the upstream function and both versions, where the restatement is put to use:
parallelize picking MiniMax's lightning attention, the ISOLATES table's lookup."""

import importlib.metadata
import inspect
import pkgutil
import re

import pytest

from parity_tests.hf import hf_models
from torch_impl.hf import kinds, upstream
from torch_impl.hf.documents import isolates_documents
from torch_impl.hf.parallelize import parallelize

LIGHTNING = "transformers.models.minimax.modeling_minimax:MiniMaxLightningAttention.forward"
PACKED = "transformers.masking_utils:find_packed_sequence_indices"
UPSTREAM = [(restating, name) for restating, names in upstream.RESTATED.items() for name in names]


@pytest.fixture
def change(monkeypatch):
    """change(name): the installed source of the upstream function `name` reads as a release that
    changed it (one line added), its digest computed anew."""
    getsource = inspect.getsource

    def change(name):
        changed = pkgutil.resolve_name(name)
        added = {changed: "# changed\n"}
        monkeypatch.setattr(inspect, "getsource", lambda f: getsource(f) + added.get(f, ""))
        upstream.source_digest.cache_clear()

    yield change
    upstream.source_digest.cache_clear()


def test_every_recorded_source_is_the_installed_releases():
    for package, release in upstream.RELEASES.items():
        assert importlib.metadata.version(package) == release, package
    for restating, name in UPSTREAM:
        assert upstream.source_digest(name) == upstream.RESTATED[restating][name], name
        assert upstream.differs(restating) is None


@pytest.mark.parametrize("restating,name", UPSTREAM)
def test_a_changed_source_is_refused_naming_both_releases(change, monkeypatch, restating, name):
    change(name)
    monkeypatch.setattr(importlib.metadata, "version", lambda package: "99.0")
    package = name.split(".")[0]
    with pytest.raises(ValueError) as error:
        upstream.check(restating)
    message = str(error.value)
    assert f"{restating} restates {name} as {package} {upstream.RELEASES[package]} has it" in message
    assert f"the installed {package} 99.0 has source " in message, message


def test_a_function_a_release_removed_is_refused(monkeypatch):
    gone = "transformers.masking_utils:gone"
    monkeypatch.setitem(upstream.RESTATED, "a restatement", {gone: "0" * 16})
    with pytest.raises(ValueError, match=re.escape(gone) + " .* has no such function"):
        upstream.check("a restatement")


def _untouched(model):
    return not hasattr(model, "cp_transport_paths") and not any("forward" in vars(m) for m in model.modules())


def test_parallelize_refuses_a_changed_lightning_attention(change):
    """Without CP (its documents kept apart) and in the walk that parallelize over a group starts
    with (no communication: run here without one), before the model changes."""
    model = hf_models.build("minimax")
    change(LIGHTNING)
    refused = re.escape("(MiniMaxLightningAttention) is made CP by a restatement of its code: ")
    refused += re.escape(f"torch_impl.hf.scans.LightningAttention restates {LIGHTNING} ")
    with pytest.raises(ValueError, match=refused):
        parallelize(model, None)
    with pytest.raises(ValueError, match=refused):
        kinds.walk(model, model.model, None, "contiguous")
    assert _untouched(model)


def test_the_isolates_table_is_refused_where_the_packed_rows_rule_changed(change):
    model = hf_models.build("minimax")
    change(PACKED)
    with pytest.raises(ValueError, match=re.escape(f"torch_impl.hf.documents.ISOLATES restates {PACKED} ")):
        isolates_documents([model.model])
    with pytest.raises(ValueError, match="ISOLATES restates"):
        parallelize(model, None)
    assert _untouched(model)
