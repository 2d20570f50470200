"""Heads that read one position of a row: transformers' sequence classification (reward models)
pooled under CP as one process pools (torch_impl.reductions), and the heads the adapter refuses."""

import re

import torch
from transformers.modeling_layers import GenericForSequenceClassification
from transformers.modeling_outputs import SequenceClassifierOutputWithPast

from torch_impl import _group
from torch_impl.hf._common import mix
from torch_impl.hf.batch import LAYOUT
from torch_impl.reductions import last_position, select_position

# a model class named for a head other than a causal LM's (e.g. ForTokenClassification,
# ForQuestionAnswering): its outputs or its loss read the whole sequence in its own way
HEAD = re.compile(r"For(?!CausalLM$|ConditionalGeneration$)[A-Z]\w*$")


def check_head(model):
    """None for a causal LM, a base model, or a sequence classification model with transformers'
    generic forward (pooled exactly by `PooledClassification`); else why the head is refused."""
    name = type(model).__name__
    if not HEAD.search(name):
        return None
    if isinstance(model, GenericForSequenceClassification) and (
        type(model).forward is GenericForSequenceClassification.forward
    ):
        return None
    return (
        "has a head that is not a causal LM's: its forward pools or scores the sequence in its own way, "
        "which each CP rank would do over its own shard (supported: *ForCausalLM, and "
        "*ForSequenceClassification with transformers' generic forward)"
    )


def apply_head(model, group, layout):
    """A sequence classification model pools as one process under CP: its class gets
    `PooledClassification` mixed in (per instance). Returns which path its head takes."""
    if not isinstance(model, GenericForSequenceClassification):
        return {}
    mix(model, PooledClassification)
    model.cp_pooling = (group, layout)
    return {"score": "pooled at the row's last real token (last_position, select_position): one process's"}


class PooledClassification:
    """Mixed into a `GenericForSequenceClassification` model's class by `parallelize`. On a shard
    (`shard_batch`'s kwargs) each rank scores its own tokens, and the row's score is read at the
    position one process pools: the last token that is not the pad token (its rule: the largest
    position whose token is not `pad_token_id`, 0 where there is none; without a pad token the
    last), found by `last_position` and read by `select_position` on every rank. Labels are one
    per row (shard_batch passes them whole). `loss` is this rank's share of the model's loss (its
    1/n: the ranks' losses add up to one process's, and so do their gradients, since
    select_position returns the sum of the ranks' gradients to the owner of the pooled token).
    An unsharded call is the model's own forward."""

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        position_ids=None,
        past_key_values=None,
        inputs_embeds=None,
        labels=None,
        use_cache=None,
        **kwargs,
    ):
        if LAYOUT not in kwargs:  # not a shard: as one process
            return super().forward(
                input_ids, attention_mask, position_ids, past_key_values, inputs_embeds, labels, use_cache,
                **kwargs,
            )  # fmt: skip
        group, layout = self.cp_pooling
        outputs = getattr(self, self.base_model_prefix)(
            input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            **kwargs,
        )
        logits = self.score(outputs.last_hidden_state)  # [B, L, labels]: this rank's tokens
        tokens = input_ids if input_ids is not None else inputs_embeds
        (B, L), n = tokens.shape[:2], _group.world_size(group)
        pad = self.config.get_text_config().pad_token_id
        if pad is None and B != 1:
            raise ValueError("Cannot handle batch sizes > 1 if no padding token is defined.")
        if pad is None or input_ids is None:  # the last position, as one process's -1
            position = torch.full((B,), n * L - 1, dtype=torch.long, device=logits.device)
        else:
            position = last_position(input_ids != pad, group, layout=layout).clamp(min=0)  # [B]
        pooled = select_position(logits, position, group, layout=layout)  # [B, labels]
        loss = None
        if labels is not None:
            loss = (
                self.loss_function(logits=logits, labels=labels, pooled_logits=pooled, config=self.config) / n
            )
        return SequenceClassifierOutputWithPast(
            loss=loss,
            logits=pooled,
            past_key_values=outputs.past_key_values,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
        )
