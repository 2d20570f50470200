"""What the adapter restates of transformers, tied to the release it restates.

Where a library offers no point to substitute at (torch_impl.hf.rebind), a few things are
restated, and a copy would silently keep the old release's behaviour. So each records, per
upstream function it restates, a digest of that function's source (`inspect.getsource`) in the
release pinned here (RELEASES, as requirements-dev.txt pins them); `check` refuses, naming both
functions and both versions, where the installed source differs. Each is checked where it is put
to use, before it runs:

- torch_impl.hf.scans.LightningAttention (with its `from_zero`): MiniMax's lightning attention
  forward; refused as its kind is picked for a layer (torch_impl.hf.recurrent.RECURRENCES).
- torch_impl.hf.media.images: Gemma 3's and Gemma 4's numbering of their images' tokens (runs of
  image tokens) and the layers and order their masks apply it in, which the attention's image
  rule reads; refused as a batch's images are numbered.
- torch_impl.hf.documents.ISOLATES: which model classes hand their mask functions the
  position_ids. What that does is transformers' rule, which the adapter restates (documents and
  inputs: packed rows, torch_impl.layout.packed_ids) and which is recorded here: rows are packed
  where position_ids come without an attention_mask or a cache (`_preprocess_mask_arguments`, the
  cache as `merge_with_config_defaults` decides it: documents.creates_cache), their documents
  numbered by `find_packed_sequence_indices`. Checked where the table is looked up
  (documents.isolates_documents). Each class's entry is the model sweep's to verify: docs/models.md
  is stamped with the transformers and TRL versions, so after an upgrade the suite fails until
  `make models` has run every family's packed rows against one process again.
"""

import functools
import hashlib
import importlib.metadata
import inspect
import pkgutil

RELEASES = {"transformers": "5.23.0"}  # the releases whose sources are recorded
# what restates -> {upstream function, "module:qualified name": its source's sha256, 16 hex digits}
RESTATED = {
    "torch_impl.hf.scans.LightningAttention": {
        "transformers.models.minimax.modeling_minimax:MiniMaxLightningAttention.forward": "69bc3f622840097c",
    },
    "torch_impl.hf.documents.ISOLATES": {
        "transformers.masking_utils:_preprocess_mask_arguments": "df23eb733c6e49fa",
        "transformers.masking_utils:find_packed_sequence_indices": "ebd2ac7ca795dbb0",
        "transformers.utils.generic:merge_with_config_defaults": "6bc988528d5780cc",
    },
    "torch_impl.hf.media.images": {
        "transformers.models.gemma3.modeling_gemma3:get_block_sequence_ids_for_mask": "7d94356db5dd8669",
        # Gemma 4's: images and videos, on sliding layers only, where its gate is "vision"
        "transformers.models.gemma4.modeling_gemma4:get_block_sequence_ids_for_mask": "d1d890e748d45932",
        "transformers.models.gemma4.modeling_gemma4:create_masks_for_vision_model": "9eaf2b7dbfe4d419",
        "transformers.models.gemma4.modeling_gemma4:Gemma4Model.forward": "b0f75616224ec6c9",
        # the unified model's: on every layer, the sliding window applied before the images
        "transformers.models.gemma4_unified.modeling_gemma4_unified:"
        "Gemma4UnifiedModel.forward": "8041ad68023da032",
        "transformers.masking_utils:create_sliding_window_causal_mask": "410bd7e79f2729a5",
    },
}


@functools.cache
def source_digest(name: str) -> str | None:
    """The sha256 of the installed source of the upstream function `name` ("module:qualified
    name"), its first 16 hex digits; None where the installed release has no such function."""
    try:
        source = inspect.getsource(pkgutil.resolve_name(name))
    except (ImportError, AttributeError):
        return None
    return hashlib.sha256(source.encode()).hexdigest()[:16]


def differs(restating: str) -> str | None:
    """Why `restating` (a RESTATED key) cannot run with the installed releases: the first upstream
    function it restates whose installed source is not the recorded one; None where none is."""
    for name, recorded in RESTATED[restating].items():
        found = source_digest(name)
        if found == recorded:
            continue
        package = name.split(".")[0]
        pinned, installed = RELEASES[package], importlib.metadata.version(package)
        now = "has no such function" if found is None else f"has source {found}"
        return (
            f"{restating} restates {name} as {package} {pinned} has it (source {recorded}); the "
            f"installed {package} {installed} {now}: install {package}=={pinned}, or bring {restating} "
            "up to date and record the new source in torch_impl.hf.upstream.RESTATED"
        )
    return None


def check(restating: str) -> None:
    """ValueError naming `restating`, the upstream function and both versions, where `differs`."""
    why = differs(restating)
    if why is not None:
        raise ValueError(f"torch_impl.hf: {why}")
