"""What a rank's sharded inputs may be, checked by `ModelInputs` (torch_impl.hf.inputs) before it
makes the forward's context: the 2-D padding mask and a cache holding no tokens (`check`), a text
batch's arguments and the images and videos torch_impl.hf.media verifies (`check_text`), and the
fields every CP rank must agree on, which the cross-rank check compares (`signature`)."""

import torch

from torch_impl.hf import media
from torch_impl.hf.batch import BATCH_KEYS, TYPE_KEYS

TEXT_INPUTS = {  # a hooked forward's parameters a text batch may pass; any other that is set is refused
    *BATCH_KEYS,
    "inputs_embeds",
    "past_key_values",
    "use_cache",
    "cache_position",
    "logits_to_keep",
    "return_dict",
    "output_attentions",
    "output_hidden_states",
    "self",
    "args",
    "kwargs",
}


def check(module, cache, mask):
    """What is wrong with this rank's attention_mask `mask` or KV cache `cache`, or None."""
    if mask is not None and (not isinstance(mask, torch.Tensor) or mask.ndim != 2):
        return (
            "torch_impl.hf: `attention_mask` must be the 2-D padding mask [B, L]; custom 4-D masks "
            "(or prepared mask dicts) cannot be split across CP ranks"
        )
    if cache is not None and cache.get_seq_length() > 0:
        return (
            f"torch_impl.hf: {type(module).__name__} was called with a KV cache holding tokens; "
            "generation with a cache is not supported under CP"
        )
    return None


def check_text(module, argument, names):
    """What is wrong with passing the hooked forward's other arguments (`names`: its parameters),
    or None: under CP a
    rank holds a shard of a text batch, and the adapter splits nothing else. A value the
    model's config holds under the same name is a setting, not an input (LLaVA's and
    Mistral 3's `vision_feature_layer`, which their forward's decorator fills in). Images and
    videos, with their token types, are taken from the families torch_impl.hf.media verifies."""
    given = media.given(argument, names)
    if given:
        error = media.refusal(module, argument, given)
        if error:
            return error
    coefficient = getattr(_text_config(module), "router_aux_loss_coef", 0.0)
    if "output_router_logits" in names and argument("output_router_logits") and coefficient:
        return (
            f"torch_impl.hf: the model was given output_router_logits=True with router_aux_loss_coef="
            f"{coefficient}: the MoE router's auxiliary loss would be each CP rank's own, a "
            "load-balancing statistic of its slice's tokens, not of the sequence's; set "
            "output_router_logits=False or router_aux_loss_coef=0.0 in the model config"
        )
    tokens = argument("input_ids") if argument("input_ids") is not None else argument("inputs_embeds")
    for name in names:
        value = argument(name)
        if name in TEXT_INPUTS or value is None or _config_setting(module, name, value):
            continue
        if given and name in media.ROW_KEYS and tuple(value.shape[:2]) != tuple(tokens.shape[:2]):
            return (
                f"torch_impl.hf: the model was given `{name}` of rows {tuple(value.shape[:2])}, not "
                f"the shard's {tuple(tokens.shape[:2])}; under CP pass it in the batch to "
                "hf.shard_batch, which shards it with the tokens"
            )
        if given and name in (*media.MEDIA_KEYS, *media.ROW_KEYS, *TYPE_KEYS):
            continue
        if name in TYPE_KEYS:
            return (
                f"torch_impl.hf: the model was given `{name}` directly; under CP pass it in the "
                "batch to hf.shard_batch, which shards it with the tokens"
            )
        return (
            f"torch_impl.hf: the model was given `{name}`; under CP a rank takes its shard of a "
            "text batch (input_ids or inputs_embeds, attention_mask, position_ids, labels) and the "
            f"batch's images and videos {media.MEDIA_KEYS}: audio and other inputs are not split "
            "across CP ranks"
        )
    return None


def signature(argument, tokens, creates_cache):
    """What must be the same on every CP rank: the shard's shape, which inputs were passed, and
    whether the model makes a cache (which decides whether packed positions are gathered)."""
    embeds = argument("input_ids") is None
    return {
        "batch": tokens.shape[0],
        "local tokens": tokens.shape[1],
        "inputs_embeds": int(embeds),
        "embedding width": tokens.shape[-1] if embeds else 0,
        "attention_mask": int(argument("attention_mask") is not None),
        "position_ids": int(argument("position_ids") is not None),
        "past_key_values": int(argument("past_key_values") is not None),
        "use_cache": int(creates_cache),
    }


def _config_setting(module, name, value):
    """Whether `value`, passed to the hooked forward as `name`, is the model config's own `name`
    or its text config's (Qwen3-Omni's thinker passes its text config's `output_router_logits`)."""
    config = getattr(module, "config", None)
    if isinstance(value, torch.Tensor) or config is None:
        return False
    settings = (getattr(c, name, _UNSET) for c in (config, _text_config(module)))
    return any(setting is not _UNSET and setting == value for setting in settings)


def _text_config(module):
    """The hooked model's text (decoder) config: its config where it has no other."""
    return module.config.get_text_config(decoder=True)


_UNSET = object()
