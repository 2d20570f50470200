"""Images and videos under CP (torch_impl.hf.media): a vision-language model given the processor's
batch, sharded by hf.shard_batch, equals one process on the whole batch (logits at every real
position, the summed loss, every gradient, the vision tower's and the projector's included), on
images whose placeholder tokens straddle shard boundaries, with a left-padded row, on 2 ranks
(contiguous) and 4 (head_tail, one rank encoding nothing), and a video for the Qwen families
(parity_tests.hf.media_cases holds the batch and the rank bodies)."""

from types import SimpleNamespace

import pytest
import torch

from parity_tests.hf import media_cases
from tools import model_sweep
from torch_impl import hf
from torch_impl.hf import media
from torch_impl.layout import ShardPlan

# every family on 4 ranks under head_tail in `make test` (a video: a frame per rank), on 2 ranks
# (contiguous) in `make test-all`
CASES = [(family, 4, "head_tail", False) for family in media.VERIFIED]
CASES += [(family, 4, "head_tail", True) for family in media.VIDEOS]
CASES += [pytest.param(family, 2, "contiguous", False, marks=pytest.mark.slow) for family in media.VERIFIED]
CASES += [pytest.param(family, 2, "contiguous", True, marks=pytest.mark.slow) for family in media.VIDEOS]


@pytest.mark.parametrize("family, n, layout, video", CASES)
def test_media_batch_equals_one_process(pool, family, n, layout, video):
    for ratios, why in pool.run(("first", n), media_cases.compare, family, layout, video)[0]:
        assert max(ratios.values()) <= 1, (family, why, ratios)


def test_gemma3_images_in_query_blocks(pool):
    """Gemma 3's chunks holding images, 3 queries at a time (blocks that cut its images and its
    sliding window unevenly), on 4 ranks under head_tail: exact."""
    for ratios, why in pool.run(("first", 4), media_cases.compare, "gemma3", "head_tail", False, 3)[0]:
        assert max(ratios.values()) <= 1, (why, ratios)


# LLaVA at cp 2 and Gemma 3 at cp 4 (head_tail) in `make test`, the rest of the matrix in `make test-all`
AUTOCAST = [("llava", 2, "contiguous"), ("gemma3", 4, "head_tail")]
AUTOCAST += [
    pytest.param(family, n, layout, marks=pytest.mark.slow)
    for family in ("llava", "gemma3")
    for n, layout in ((2, "contiguous"), (4, "head_tail"), (2, "head_tail"), (4, "contiguous"))
    if (family, n, layout) not in AUTOCAST
]


@pytest.mark.parametrize("family, n, layout", AUTOCAST)
def test_one_image_under_bfloat16_autocast(pool, family, n, layout):
    """A float32 model under TRL's bf16 autocast with one image: the ranks that encode nothing send
    the features' dtype (bfloat16, the projector's under autocast), not the embeddings' float32;
    the loss and gradients are one process's under the same autocast, within its bound."""
    for ratios in pool.run(("first", n), media_cases.autocast, family, layout)[0]:
        assert max(ratios.values()) <= 1, (family, ratios)


def test_unverified_media_are_refused():
    """A family not in media.VERIFIED (a new release's): its media refused, saying so."""
    module = SimpleNamespace(config=SimpleNamespace(model_type="next_vlm"))
    message = media.refusal(module, lambda name: None, ["pixel_values"])
    assert "next_vlm its vision inputs are not verified under CP" in message, message


def test_a_family_refused_for_its_model_says_why():
    """A family in media.REFUSED: its reason, not "not verified", in media.refusal's message and in
    docs/models.md's media column."""
    module = SimpleNamespace(config=SimpleNamespace(model_type="mistral4"))
    message = media.refusal(module, lambda name: None, ["pixel_values"])
    assert media.REFUSED["mistral4"] in message, message
    assert model_sweep.media_verdict(None, "mistral4") == ("refused", media.REFUSED["mistral4"])
    section = model_sweep.MATRIX.read_text().split("## Image-text-to-text classes")[1]
    row = next(line for line in section.splitlines() if line.startswith("| `mistral4` |"))
    assert "no vision tower" in row, row


def test_granite_docling_with_a_density_router_is_refused():
    """Granite Docling's images are split, but its density router (a logit a row from the row's
    tiles) is not: a config with one is refused, saying so; one without is not."""
    config = SimpleNamespace(model_type="granite_docling", density_router_hidden_size=8)
    message = media.refusal(SimpleNamespace(config=config), lambda name: None, ["pixel_values"])
    assert message and "density router" in message, message
    config.density_router_hidden_size = None
    ids = {"input_ids": torch.ones(1, 4, dtype=torch.long)}
    assert media.refusal(SimpleNamespace(config=config), ids.get, ["pixel_values"]) is None


def test_local_views_and_packed_rows_of_patches_are_refused():
    """DeepSeek-OCR 2's local views (ranks would call the tower a different number of times, which
    FSDP2 cannot pair) and MiniCPM-V's pixel_values of more than one row (the model encodes the
    first): refused, saying why."""
    given = {"input_ids": torch.ones(1, 4, dtype=torch.long), "pixel_values_local": torch.zeros(1, 3, 8, 8)}
    ocr = SimpleNamespace(config=SimpleNamespace(model_type="deepseek_ocr2"))
    assert "local views" in media.refusal(ocr, given.get, ["pixel_values", "pixel_values_local"])
    given = {"input_ids": torch.ones(1, 4, dtype=torch.long), "pixel_values": torch.zeros(2, 3, 4, 32)}
    minicpm = SimpleNamespace(config=SimpleNamespace(model_type="minicpmv4_6"))
    assert "pixel_values of 2 rows" in media.refusal(minicpm, given.get, ["pixel_values"])
    given["pixel_values"] = given["pixel_values"][:1]
    assert media.refusal(minicpm, given.get, ["pixel_values"]) is None


def _gemma4(model_type, gate, window=8):
    """A stand-in for a Gemma 4 model for media.images: its config's type, gate and window."""
    text = SimpleNamespace(use_bidirectional_attention=gate, sliding_window=window)
    return SimpleNamespace(config=SimpleNamespace(model_type=model_type, get_text_config=lambda: text))


def test_gemma4_images_follow_their_gate_and_layers():
    """Gemma 4's images and videos (types 1 and 2, one run) are blocks only where its gate is
    "vision", and on its sliding layers only; the unified model's on every layer."""
    types = torch.tensor([[0, 1, 1, 2, 0, 1, 0, 0]])
    shard = ShardPlan.of("contiguous", 2, 0, 4)
    assert media.images(_gemma4("gemma4", None), types, shard) is None
    found = media.images(_gemma4("gemma4", "vision"), types, shard)
    assert found.ids.tolist() == [[-1, 0, 0, 0, -1, 1, -1, -1]] and not found.full
    assert found.ahead == (0, 0) and found.seeing == frozenset({0, 1})
    assert media.images(_gemma4("gemma4_unified", "vision"), types, shard).full


def test_unified_images_past_the_window_are_refused():
    """The unified model's sliding layers let an image see itself past the window, which the
    attention's rule does not: an image longer than the window is refused; one as long is not."""
    shard = ShardPlan.of("contiguous", 2, 0, 8)
    types = torch.zeros(1, 16, dtype=torch.long)
    types[0, 2:10] = 1  # 8 tokens: the window
    assert media.images(_gemma4("gemma4_unified", "vision"), types, shard) is not None
    types[0, 10] = 1
    with pytest.raises(ValueError, match=r"an image of 9 tokens, longer than its sliding_window \(8\)"):
        media.images(_gemma4("gemma4_unified", "vision"), types, shard)


def test_unverified_videos_are_refused(pool):
    """Kimi K2.5's images are split, its videos not (its tower merges a video's frames: not
    verified): a batch with a video is refused, saying so, on every rank."""
    for message in pool.run(("first", 2), media_cases.video_refused, "kimi_k25")[0]:
        assert message and "kimi_k25 its videos are not verified under CP" in message, message


def test_glm_images_beside_a_video_are_refused():
    """GLM marks a video's frames with the image token: images and a video in one batch, which its
    forward cannot take either, are refused before any tower runs, saying why."""
    module = SimpleNamespace(config=SimpleNamespace(model_type="glm4v"))
    message = media.refusal(module, lambda name: None, ["pixel_values", "pixel_values_videos"])
    assert "its forward takes images or a video, not both" in message, message
    given = {"input_ids": torch.zeros(1, 4, dtype=torch.long)}.get
    assert media.refusal(module, given, ["pixel_values_videos"]) is None


def test_packed_rows_with_gemma3_images_are_refused(pool):
    """Packed rows with images whose tokens see each other: transformers' sliding masks read the
    image ids by each document's positions, mixing documents; refused on every rank."""
    for message in pool.run(("first", 2), media_cases.packed_refused, "gemma3")[0]:
        assert message and "which mixes documents" in message, message


def test_share_is_contiguous_and_balanced():
    """Each rank's items: contiguous, in rank order, every item once, balanced by pixel rows."""
    assert media.share([1, 1, 1], 2) == [(0, 1), (1, 3)]  # an item goes where its middle falls
    assert media.share([1, 1, 1], 4) == [(0, 1), (1, 1), (1, 2), (2, 3)]
    assert media.share([32, 16, 16, 32], 2) == [(0, 2), (2, 4)]
    assert media.share([100, 1, 1, 1], 2) == [(0, 1), (1, 4)]
    for weights in ([3, 1, 4, 1, 5, 9, 2, 6], [1] * 7, [5]):
        parts = media.share(weights, 3)
        assert parts[0][0] == 0 and parts[-1][1] == len(weights)
        assert all(a[1] == b[0] for a, b in zip(parts, parts[1:], strict=False))


def test_shard_batch_passes_media_whole_and_shards_token_types():
    """Media go to every rank whole, the token types with the tokens; types marking media in a
    batch without any are refused."""
    ids = torch.arange(16).view(2, 8)
    types = (ids % 3 == 0).long()
    pixels = torch.randn(5, 12)
    grid = torch.tensor([[1, 1, 5]])
    batch = {"input_ids": ids, "mm_token_type_ids": types, "pixel_values": pixels, "image_grid_thw": grid}

    local = hf.shard_batch(batch, None)
    assert local["pixel_values"] is pixels and local["image_grid_thw"] is grid
    assert torch.equal(local["mm_token_type_ids"], types)
    with pytest.raises(ValueError, match=r"marks image or video tokens .* holds no images"):
        hf.shard_batch({"input_ids": ids, "mm_token_type_ids": types}, None)


def test_shard_batch_takes_a_cross_attention_mask_of_the_tokens_rows():
    """Mllama's cross_attention_mask [B, S, images, tiles] (media.ROW_KEYS) goes with the tokens
    (split by rows on each rank: test_media_batch_equals_one_process), its images' aspect ratios
    whole; a mask of other rows refused."""
    ids = torch.arange(16).view(2, 8)
    sees = torch.arange(2 * 8 * 2 * 3).view(2, 8, 2, 3)
    ratios = torch.tensor([[1, 2], [3, 0]])
    local = hf.shard_batch({"input_ids": ids, "cross_attention_mask": sees, "aspect_ratio_ids": ratios}, None)
    assert torch.equal(local["cross_attention_mask"], sees) and local["aspect_ratio_ids"] is ratios
    with pytest.raises(ValueError, match=r"cross_attention_mask.*must start with \[B, S\]"):
        hf.shard_batch({"input_ids": ids, "cross_attention_mask": sees[:, :4]}, None)


def test_mllama_images_need_their_cross_attention_mask_of_the_shards_rows():
    """Mllama's images without a cross_attention_mask (sdpa would then align its cross-attention
    causally to each rank's own rows), or with one of other rows than the shard's (the model would
    keep its first rows): refused, saying why."""
    from transformers import MllamaConfig

    from torch_impl.hf import input_checks

    module = SimpleNamespace(config=MllamaConfig())
    given = {"input_ids": torch.zeros(2, 8, dtype=torch.long), "pixel_values": torch.zeros(2, 1, 1, 3, 4, 4)}
    names = ["input_ids", "pixel_values", "cross_attention_mask"]
    message = input_checks.check_text(module, given.get, names)
    assert "without a cross_attention_mask" in message, message
    given["cross_attention_mask"] = torch.ones(2, 16, 1, 1)  # the whole row's, not the shard's 8
    message = input_checks.check_text(module, given.get, names)
    assert "`cross_attention_mask` of rows (2, 16), not the shard's (2, 8)" in message, message
    given["cross_attention_mask"] = torch.ones(2, 8, 1, 1)
    assert input_checks.check_text(module, given.get, names) is None
