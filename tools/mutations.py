"""Plausible bugs in the library, each of which some test of the suite must catch (`make mutants`).

    .venv/bin/python -m tools.mutations [NAME ...]

Each mutation is one textual change to one file of the library and the tests that must fail on
it. The script copies the tracked tree to a temporary folder per mutation, applies the change
there, runs those tests with this interpreter and reports whether they failed ("caught"); it exits
1 when one was not. (parity_tests/harness/mutants.py holds the deliberately wrong transports that the
parity suite's own self-check runs in every `make test`.)
"""

import os
import subprocess
import sys
import tempfile
import time
from typing import NamedTuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMEOUT_S = 600


class Mutation(NamedTuple):
    name: str
    path: str
    old: str
    new: str
    tests: tuple  # pytest arguments that select the tests which must fail


MUTATIONS = [
    Mutation(  # a row's sum left local: each rank's partial sum taken for the row's
        "row_sum_left_local",
        "torch_impl/reductions.py",
        "return partial if _group.world_size(group) == 1 else _SumOverRanks.apply(partial, group)",
        "return partial",
        ("parity_tests/transport/test_reductions.py", "-k", "parity", "-x"),
    ),
    Mutation(  # the pooled position found from the local shard: each rank's own last real token
        "pooled_position_from_the_local_shard",
        "torch_impl/reductions.py",
        "return found if _group.world_size(group) == 1 else _all_reduce(found, group, dist.ReduceOp.MAX)",
        "return found",
        ("parity_tests/hf/test_hf_heads.py", "-x"),
    ),
    Mutation(  # the pooled token read at its local row on every rank, not at its global one
        "pooled_token_read_on_the_wrong_rank",
        "torch_impl/reductions.py",
        "owned = _positions(x, group, layout)[None] == position[:, None]",
        "owned = torch.arange(x.shape[1], device=x.device)[None] == position[:, None] % x.shape[1]",
        ("parity_tests/transport/test_reductions.py", "-k", "parity", "-x"),
    ),
    Mutation(  # a reduction whose backward multiplies by the CP size
        "reduction_backward_times_cp_size",
        "torch_impl/reductions.py",
        "return _all_reduce(grad, ctx.group), None",
        "return _all_reduce(grad, ctx.group) * dist.get_world_size(ctx.group), None",
        ("parity_tests/transport/test_reductions.py", "-k", "parity", "-x"),
    ),
    Mutation(  # the fused head's outputs gathered in the ranks' order, not the rows' (head_tail)
        "whole_row_outputs_gathered_in_local_order",
        "torch_impl/hf/whole_rows.py",
        "fields[name] = gather_sequence(value, group, layout=layout)[:, :positions]",
        "fields[name] = gather_sequence(value, group)[:, :positions]",
        ("parity_tests/hf/test_whole_rows.py", "-k", "head_tail"),
    ),
    Mutation(  # the labels shifted within each shard: a shard's last token predicts its own first
        "whole_row_labels_shifted_within_the_shard",
        "torch_impl/hf/whole_rows.py",
        'del local["labels"]',
        'local["shift_labels"] = local.pop("labels").roll(-1, 1)',
        ("parity_tests/trainer/test_trainer.py", "-k", "dpo_llama or kto_llama"),
    ),
    Mutation(  # the gather's backward averaging the ranks' gradients of a position, not summing them
        "gather_backward_averages_the_ranks",
        "torch_impl/sequence.py",
        "return reduce_scatter(grad_output, ctx.group, ctx.layout), None, None",
        "return reduce_scatter(grad_output / _group.world_size(ctx.group), ctx.group, ctx.layout), "
        "None, None",
        ("parity_tests/hf/test_whole_rows.py",),
    ),
    Mutation(  # DPO's and KTO's loss scaled by the CP size on top of the gather's sum over ranks
        "whole_row_loss_scaled_twice_by_the_cp_size",
        "torch_impl/hf/trainer.py",
        "            return whole\n",
        "            return whole * self.cp_size\n",
        ("parity_tests/trainer/test_trainer.py", "-k", "dpo_llama or kto_llama or grpo_llama"),
    ),
    Mutation(  # a replica's CP ranks keep the completions each sampled (their random states differ)
        "rollout_cp_ranks_sample_their_own_completions",
        "torch_impl/hf/rl.py",
        "dist.broadcast_object_list(sent, src=dist.get_global_rank(t.cp_group, 0), group=t.cp_group)",
        "sent = [completion_ids, _random_states()]",
        ("parity_tests/trainer/test_trainer.py", "-k", "grpo_llama or rloo_llama"),
    ),
    Mutation(  # GRPO's rewards, gathered over every process, grouped with the CP ranks' copies
        "grpo_advantages_over_the_cp_group",
        "torch_impl/hf/rl.py",
        '"gather": functools.partial(t._gather_replicas, cut=False)',
        '"gather": t.accelerator.gather',
        ("parity_tests/trainer/test_trainer.py", "-k", "grpo"),
    ),
    Mutation(  # GRPO: each process seeded by its own index, as TRL does, not as its replica's
        "grpo_seeded_by_process_not_replica",
        "torch_impl/hf/trainer.py",
        "set_seed(self.args.seed + self.dp_index)",
        "set_seed(self.args.seed + self.accelerator.process_index)",
        ("parity_tests/trainer/test_trainer.py", "-k", "grpo"),
    ),
    Mutation(  # RLOO's KL penalty in the reward gathered over every process: `gather` not rebound
        "rloo_kl_penalty_gathered_over_every_process",
        "torch_impl/hf/rl.py",
        '"_generate_and_score_completions": ("gather", "gather_object"),',
        '"_generate_and_score_completions": ("gather_object",),',
        ("parity_tests/trainer/test_rl.py", "-k", "rebound"),
    ),
    Mutation(  # MiniMax's lightning correction decayed from the token itself, one step short
        "lightning_decay_one_token_short",
        "torch_impl/hf/scans.py",
        "places = torch.arange(1, C + 1, device=q.device, dtype=rate.dtype)[:, None]",
        "places = torch.arange(0, C, device=q.device, dtype=rate.dtype)[:, None]",
        ("parity_tests/hf/test_models.py", "-k", "minimax"),
    ),
    Mutation(  # RecurrentGemma's RG-LRU: the earlier ranks' state not carried in
        "rg_lru_state_not_carried",
        "torch_impl/hf/scans.py",
        "return (h0 + carried * state.reshape(batch, 1, W))",
        "return (h0 + 0 * carried * state.reshape(batch, 1, W))",
        ("parity_tests/hf/test_models.py", "-k", "recurrent_gemma"),
    ),
    Mutation(  # RecurrentGemma's conv over its own shard only, no halo
        "griffin_conv_without_a_halo",
        "torch_impl/hf/scans.py",
        "windows = ShardPlan.of(self.layout, n, r, L).windows(conv.kernel_size[0] - 1)",
        "windows = ShardPlan.of(self.layout, n, r, L).windows(0)",
        ("parity_tests/hf/test_models.py", "-k", "recurrent_gemma"),
    ),
    Mutation(  # a sequence whose last strip is partial loses it
        "reverse_blocks_skips_a_partial_strip",
        "torch_impl/sequence.py",
        "for row in range(0, blocks.shape[1], step):",
        "for row in range(0, blocks.shape[1] - step + 1, step):",
        ("parity_tests/transport/test_parity_layouts.py", "-k", "head_tail_sequence"),
    ),
    Mutation(  # the indexer's second query block reads the first block's rows
        "indexer_blocks_use_block_0_rows",
        "torch_impl/hf/indexed.py",
        "mask = context.visible(queries[None, :, None],",
        "mask = context.visible(query_rows[: len(queries)][None, :, None],",
        ("parity_tests/hf/test_hf_indexed.py", "-k", "several_query_blocks"),
    ),
    Mutation(  # dp taken from the cp dimension (the same size when dp = cp)
        "dp_size_from_the_cp_dimension",
        "torch_impl/hf/data_parallel.py",
        'return mesh[dp_dim, cp_dim]._flatten(f"{dp_dim}_{cp_dim}"), mesh[dp_dim].size()',
        'return mesh[dp_dim, cp_dim]._flatten(f"{dp_dim}_{cp_dim}"), mesh[cp_dim].size()',
        ("parity_tests/hf/test_hf_inputs.py", "-k", "data_parallel_gradients"),
    ),
    Mutation(  # apply_ddp(global_num_items=True) ignored
        "apply_ddp_drops_global_num_items",
        "torch_impl/hf/data_parallel.py",
        "global_num_items=global_num_items, dp_dim=dp_dim, cp_dim=cp_dim)\n    ddp = ",
        "dp_dim=dp_dim, cp_dim=cp_dim)\n    ddp = ",
        ("parity_tests/hf/test_hf_inputs.py", "-k", "data_parallel_gradients and ddp"),
    ),
    Mutation(  # only 2 of the inputs check's 8 fields were ever made to differ
        "inputs_check_never_compares_position_ids",
        "torch_impl/hf/input_checks.py",
        '"position_ids": int(argument("position_ids") is not None),',
        '"position_ids": int(argument("attention_mask") is not None),',
        ("parity_tests/hf/test_hf_inputs.py", "-k", "different_inputs"),
    ),
    # what the hf equality bounds must still see (parity_tests/hf/hf_reference.py's docstring)
    Mutation(
        "plan_windows_one_key_early",
        "torch_impl/layout.py",
        "first_key = 0 if h is None else start - min(start, h)",
        "first_key = 0 if h is None else max(0, start - min(start, h) - 1)",
        ("parity_tests/transport/test_layout.py", "-k", "shard_plan"),
    ),
    Mutation(
        "head_tail_gather_swaps_two_tokens",
        "torch_impl/sequence.py",
        "    _reverse_blocks(out[half:], n)\n    return out.transpose(0, 1)",
        "    _reverse_blocks(out[half:], n)\n    out[[half, half + 1]] = out[[half + 1, half]]\n"
        "    return out.transpose(0, 1)",
        ("parity_tests/hf/test_hf.py", "-k", "packed_sequences_equal and deepseek_v32-head_tail"),
    ),
    Mutation(
        "window_one_key_longer",
        "torch_impl/hf/attention.py",
        "            window=window,\n            scale=",
        "            window=None if window is None else window + 1,\n            scale=",
        ("parity_tests/hf/test_hf.py", "-k", "one_process_float64 and (mistral or gemma3)"),
    ),
    Mutation(
        "document_ids_one_token_late",
        "torch_impl/hf/inputs.py",
        "documents = packed_ids(everywhere)  # [B, S]",
        "documents = F.pad(packed_ids(everywhere)[:, :-1], (1, 0))  # [B, S]",
        ("parity_tests/hf/test_hf.py", "-k", "packed_sequences_equal and deepseek_v32"),
    ),
    Mutation(
        "full_attention_drops_the_padding",
        "torch_impl/hf/masks.py",
        "padding = None if attention_mask is None else context.padding  # bool [B, S]",
        "padding = None  # bool [B, S]",
        ("parity_tests/hf/test_hf.py", "-k", "(one_process_float64 or head_tail_layout) and llama"),
    ),
    Mutation(
        "indexed_attention_drops_the_padding",
        "torch_impl/hf/indexed.py",
        "self.padding = context.padding  # bool [B, S] by global position, or None",
        "self.padding = None  # bool [B, S] by global position, or None",
        ("parity_tests/hf/test_hf_indexed.py", "-k", "indexed_attention_with_left_padding and deepseek"),
    ),
]


MUTATIONS += [
    Mutation(  # packed rows' layers fetch their whole window or prefix: exact, but more bytes
        "packed_rows_ignore_the_documents_reach",
        "torch_impl/hf/inputs.py",
        "Documents(documents, reaches.pop(0), document_starts(documents)) if values[-1] else None",
        "Documents(documents, (reaches.pop(0), None)[1], document_starts(documents)) if values[-1] else None",
        ("parity_tests/hf/test_hf.py", "-k", "packed_rows_move_only"),
    ),
    Mutation(
        "document_reach_one_token_short",
        "torch_impl/layout.py",
        "return (starts - firsts).amax(dim=0)",
        "return (starts - firsts).amax(dim=0).sub(1).clamp(min=0)",
        ("parity_tests/hf/test_hf.py", "-k", "packed_sequences_equal and (gemma3 or deepseek_v32)"),
    ),
    Mutation(
        "documents_isolated_where_one_process_does_not",
        "torch_impl/hf/inputs.py",
        "if packed and self.isolates:",
        "if packed:",
        ("parity_tests/hf/test_hf.py", "-k", "packed_sequences_equal and gpt_oss"),
    ),
    Mutation(
        "tiles_skip_the_first_key_of_a_document",
        "torch_impl/attention/plan.py",
        "lo = max(lo, earliest)",
        "lo = max(lo, earliest + 1)",
        ("parity_tests/attention/test_attention.py", "-k", "skips_tiles or skipped_tile"),
    ),
    Mutation(
        "tiles_unmasked_across_documents",
        "torch_impl/attention/plan.py",
        "return masked or k0 < latest",
        "return masked",
        ("parity_tests/attention/test_attention.py", "-k", "skips_tiles"),
    ),
    Mutation(
        "sinks_gradient_of_the_wrong_sign",
        "torch_impl/attention/tiles.py",
        "grad_sinks = -(weight * rows).sum((0, 2)).to(sinks.dtype)",
        "grad_sinks = (weight * rows).sum((0, 2)).to(sinks.dtype)",
        ("parity_tests/attention/test_attention.py", "-k", "sink"),
    ),
    Mutation(
        "soft_cap_backward_skips_the_tanh_derivative",
        "torch_impl/attention/tiles.py",
        "dscores.mul_(sig.addcmul_(sig, sig, value=-1))",
        "sig.addcmul_(sig, sig, value=-1)",
        ("parity_tests/attention/test_attention.py", "-k", "brute_force and softcap"),
    ),
    Mutation(
        "adapter_drops_gemma2s_soft_cap",
        "torch_impl/hf/attention.py",
        'softcap=kwargs.get("softcap"),',
        "softcap=None,",
        ("parity_tests/hf/test_hf.py", "-k", "one_process_float64 and gemma2"),
    ),
    Mutation(
        "adapter_drops_gpt_oss_sinks",
        "torch_impl/hf/attention.py",
        'sinks=kwargs.get("s_aux"),',
        "sinks=None,",
        ("parity_tests/hf/test_hf.py", "-k", "one_process_float64 and gpt_oss"),
    ),
    Mutation(  # each CP rank counts its replica's whole batch: the loss, and SGD's step, 1/cp as large
        "trainer_count_not_divided_by_cp",
        "torch_impl/hf/trainer.py",
        "    def get_cp_size(self):\n        return self.cp_size",
        "    def get_cp_size(self):\n        return 1",
        ("parity_tests/trainer/test_trainer.py", "-k", "over_cp_equals_it_without and trainer_gemma3"),
    ),
    Mutation(  # TRL's factor for average_tokens_across_devices left in a no-loss-kwargs model's loss
        "micro_batch_mean_times_the_processes",
        "torch_impl/hf/trainer.py",
        "loss = loss * (self.cp_size / scale)",
        "loss = loss * self.cp_size",
        ("parity_tests/trainer/test_trainer.py", "-k", "over_cp_equals_it_without and sft_gemma4_images"),
    ),
    Mutation(  # a no-loss-kwargs model's loss each CP rank's own slice's mean (times cp)
        "micro_batch_mean_of_the_slice",
        "torch_impl/hf/trainer.py",
        'local | {"num_items_in_batch": count}',
        "local",
        ("parity_tests/trainer/test_trainer.py", "-k", "over_cp_equals_it_without and trainer_gemma4"),
    ),
    Mutation(  # Mllama's cross-attention without its mask: every token seeing every image
        "cross_attention_unmasked",
        "torch_impl/hf/attention.py",
        "return module.context_parallel.attend(module, query, key, value, attention_mask, **kwargs)",
        "return module.context_parallel.attend(module, query, key, value, None, **kwargs)",
        ("parity_tests/hf/test_hf_media.py", "-k", "equals_one_process and mllama-4"),
    ),
    Mutation(  # every video split into frames, MiniMax-M3-VL's too, whose tower attends across them
        "video_frames_split_where_the_tower_mixes_them",
        "torch_impl/hf/media.py",
        "chunk = _frame_chunks(module.config, t) if video else torch.ones_like(t)",
        "chunk = torch.ones_like(t)",
        ("parity_tests/hf/test_hf_media.py", "-k", "equals_one_process and minimax_m3_vl-4-head_tail-True"),
    ),
    Mutation(  # the CP ranks of a replica would get different rows (the inputs check raises)
        "trainer_rows_sharded_over_every_process",
        "torch_impl/hf/trainer.py",
        "sharded.num_processes, sharded.process_index = self.dp_size, self.dp_index",
        "sharded.num_processes = sharded.num_processes",
        ("parity_tests/trainer/test_trainer.py", "-k", "same_rows"),
    ),
    Mutation(  # a document's ids taken for one run: its tiles skipped where the ids come back
        "document_spans_assume_one_run_per_id",
        "torch_impl/attention/plan.py",
        "if documents.shape[1] > 1 and bool((documents[:, 1:] < documents[:, :-1]).any()):",
        "if False:",
        ("parity_tests/attention/test_attention.py", "-k", "brute_force"),
    ),
    Mutation(  # a decorator kept though it could still call the old forward elsewhere
        "rebind_keeps_a_decorator_holding_the_old_forward",
        "torch_impl/hf/rebind.py",
        "if not _holds_only_in_cells(outer, inner):",
        "if False:",
        ("parity_tests/hf/test_rebind.py", "-k", "elsewhere"),
    ),
    Mutation(  # the caller's document starts taken by global row, not by key row
        "document_starts_not_shifted_to_key_rows",
        "torch_impl/attention/plan.py",
        "local = None if starts is None else starts - k_start",
        "local = starts",
        ("parity_tests/attention/test_attention.py", "-k", "scan_no_ids"),
    ),
    Mutation(  # the tiles scan each call's ids again instead of the forward's starts
        "tiles_not_handed_the_forwards_starts",
        "torch_impl/hf/attention.py",
        "document_starts=keys.starts,",
        "document_starts=None,",
        ("parity_tests/hf/test_hf.py", "-k", "two_ranks", "-x"),
    ),
    Mutation(  # a chunk's query starts cut at its keys' rows, not its queries'
        "chunk_starts_cut_at_the_keys",
        "torch_impl/hf/masks.py",
        "None if first is None else first[:, w.start : w.end],",
        "None if first is None else first[:, w.first_key : w.first_key + w.end - w.start],",
        ("parity_tests/hf/test_hf.py", "-k", "packed_sequences_equal and gemma3", "-x"),
    ),
    Mutation(  # per-chunk halo sizes unchecked across ranks: gloo aborts on a message of another size
        "per_chunk_halo_sizes_unchecked",
        "torch_impl/validation.py",
        "_code(str(list(halo_size))) if isinstance(halo_size, (tuple, list)) else -1,",
        "0 if isinstance(halo_size, (tuple, list)) else -1,",
        ("parity_tests/transport/test_reliability.py", "-k", "per_chunk"),
    ),
    # the model sweep's quick subset (parity_tests/hf/test_models.py) must see these
    Mutation(  # OPT's positions as every other family's: its left-padded row shifts by 3
        "opt_positions_count_every_token",
        "torch_impl/hf/inputs.py",
        "        if padding is None:\n            return rows\n        count",
        "        if True:\n            return rows\n        count",
        ("parity_tests/hf/test_models.py", "-k", "family_equals and opt"),
    ),
    Mutation(  # RoBERTa's positions from the rows, blind to its pad tokens
        "roberta_positions_ignore_the_pad_tokens",
        "torch_impl/hf/inputs.py",
        "        if ids is None:\n            return rows + pad + 1",
        "        if True:\n            return rows + pad + 1",
        ("parity_tests/hf/test_models.py", "-k", "family_equals and roberta"),
    ),
    Mutation(  # packed rows' attention chunks counted from the row's start, not each document's
        "chunks_from_the_rows_in_packed_rows",
        "torch_impl/hf/inputs.py",
        "    if documents is not None:\n        within",
        "    if False:\n        within",
        ("parity_tests/hf/test_models.py", "-k", "family_equals and llama4"),
    ),
    Mutation(  # Llama 4's NoPE layers keep the scales of their local rows
        "nope_queries_keep_their_local_scale",
        "torch_impl/hf/attention.py",
        "query = query / local[:, None] * wanted[:, None]",
        "query = query / local[:, None] * local[:, None]",
        ("parity_tests/hf/test_models.py", "-k", "family_equals and llama4"),
    ),
    Mutation(  # Qwen4's QSA blocks pooled over every earlier key, padding and other documents included
        "qsa_blocks_over_every_earlier_key",
        "torch_impl/hf/indexed.py",
        "seen = context.visible(queries[None, :, None], key_rows[None, None, :cut])",
        "seen = key_rows[None, None, :cut] <= queries[None, :, None]",
        ("parity_tests/hf/test_models.py", "-k", "family_equals and qwen4"),
    ),
    Mutation(  # DeepSeek V4: a window crossing the shard edge compressed without the earlier rank's tokens
        "compressed_window_cut_at_the_shard_edge",
        "torch_impl/hf/compressed.py",
        "h = fetched[:, w.segment]",
        "h = fetched[:, w.segment] * (torch.arange(w.end - first) >= w.start - first)[None, :, None]",
        ("parity_tests/hf/test_models.py", "-k", "family_equals and deepseek_v4"),
    ),
    Mutation(  # gather_halo's lookahead: a later chunk sends its end instead of its start
        "lookahead_sends_the_chunk_end",
        "torch_impl/halo.py",
        "plan.append(Transfer(src, shard.r, c * C - w.first_key, length, p * C, k))",
        "plan.append(Transfer(src, shard.r, c * C - w.first_key, length, (p + 1) * C - length, k))",
        ("parity_tests/transport/test_parity_layouts.py", "-k", "lookahead", "-x"),
    ),
    Mutation(  # Gemma 3: an image's tokens on later ranks not fetched (its block cut at the chunk's end)
        "image_block_cut_at_the_shard_edge",
        "torch_impl/hf/media.py",
        "torch.cat([spill.amax(dim=0), spill.new_zeros(1), seeing.long(), longest[None]])",
        "torch.cat([spill.amax(dim=0) * 0, spill.new_zeros(1), seeing.long(), longest[None]])",
        ("parity_tests/hf/test_hf_media.py", "-k", "gemma3 and equals", "-x"),
    ),
    Mutation(  # Gemma 4: its full layers' image tokens see their whole image (as Gemma 3's do)
        "gemma4_images_on_full_layers",
        "torch_impl/hf/masks.py",
        "if images is not None and window is None and not images.full:",
        "if images is not None and window is None and not images:",
        ("parity_tests/hf/test_hf_media.py", "-k", "gemma4-4", "-x"),
    ),
    Mutation(  # Gemma 4 unified: an image longer than the sliding window split (its rule differs)
        "unified_image_past_the_window",
        "torch_impl/hf/media.py",
        "if rule.up_to_window and window is not None and both[-1] > window:",
        "if rule.up_to_window and window is not None and both[-1] > 2 * window:",
        ("parity_tests/hf/test_hf_media.py", "-k", "past_the_window"),
    ),
    Mutation(  # Gemma 3: image tokens causal, as text (the bidirectional rule dropped)
        "image_tokens_causal",
        "torch_impl/hf/attention.py",
        "seen = (k <= q)[None] | ((own == theirs) & (own >= 0))",
        "seen = (k <= q)[None] & (own >= -1)",
        ("parity_tests/hf/test_hf_media.py", "-k", "gemma3 and equals", "-x"),
    ),
    Mutation(  # Inkling: a key's relative bias read at its distance from the chunk's first key
        "relative_bias_at_a_local_distance",
        "torch_impl/hf/inkling.py",
        "k = torch.arange(first + cut.start, first + cut.stop, device=query.device)",
        "k = torch.arange(cut.start, cut.stop, device=query.device)",
        ("parity_tests/hf/test_models.py", "-k", "family_equals and inkling2_text"),
    ),
    Mutation(  # Inkling2: the token-dependent conv of a chunk's first tokens without the earlier rank's
        "token_conv_without_its_halo",
        "torch_impl/hf/inkling.py",
        "halo = fetched[:, w.segment][:, :before]",
        "halo = torch.zeros_like(fetched[:, w.segment][:, :before])",
        ("parity_tests/hf/test_models.py", "-k", "family_equals and inkling2_text"),
    ),
    Mutation(  # Qwen4's PLE: the n-grams of a chunk's first tokens without the ids before the chunk
        "ple_ngrams_cut_at_the_chunk",
        "torch_impl/hf/ple.py",
        "ids_ = ids_.masked_fill(rows < start, self.ple_embedding.eos_token_id)",
        "ids_ = ids_.masked_fill((rows < start) | (rows < w.start), self.ple_embedding.eos_token_id)",
        ("parity_tests/hf/test_models.py", "-k", "family_equals and qwen4_exp_text"),
    ),
    Mutation(  # Qwen4's PLE: its dilated conv reading the earlier rank's rows as zeros
        "ple_conv_without_its_halo",
        "torch_impl/hf/ple.py",
        "x = chunk_states[b, begin - w.first_key : stop - w.first_key]",
        "x = chunk_states[b, begin - w.first_key : stop - w.first_key] * (rows[back:] >= w.start)[:, None]",
        ("parity_tests/hf/test_models.py", "-k", "family_equals and qwen4_exp_text"),
    ),
    Mutation(  # Qwen4's PLE: packed documents' n-grams reading ids of the document before
        "ple_ngrams_across_a_document_start",
        "torch_impl/hf/ple.py",
        "start = rows.new_zeros(()) if first is None else first[b, begin][:, None]",
        "start = rows.new_zeros(())",
        ("parity_tests/hf/test_models.py", "-k", "family_equals and qwen4_exp_text"),
    ),
    Mutation(  # DeepSeek V4: entries of windows not closed yet (HCA's; CSA's indexer) seen by a query
        "compressed_entry_seen_before_its_window_closes",
        "torch_impl/hf/compressed.py",
        "position_ids[:, rows], serving, layer_idx",
        "position_ids[:, rows] + self.compress_rate, serving, layer_idx",
        ("parity_tests/hf/test_models.py", "-k", "family_equals and deepseek_v4"),
    ),
    Mutation(  # MiniMax-M3's indexer given its own rank's keys in every rank's slots
        "block_indexer_sees_only_its_own_keys",
        "torch_impl/hf/block_sparse.py",
        "keys = gather_sequence(own.computed[:, 0], context.group, layout=context.shard.layout)",
        "keys = torch.cat([own.computed[:, 0]] * context.shard.n, dim=1)",
        ("parity_tests/hf/test_models.py", "-k", "family_equals and minimax_m3"),
    ),
    Mutation(  # Qwen4's QSA indexer given only the rank's own keys: blocks of the earlier ranks lost
        "qsa_indexer_sees_only_its_own_keys",
        "torch_impl/hf/indexed.py",
        "keys = context.prefix(own.computed)  # [B, T, Di]",
        "keys = torch.nn.functional.pad(own.computed, (0, 0, len(context.key_rows) - L, 0))  # [B, T, Di]",
        ("parity_tests/hf/test_models.py", "-k", "family_equals and qwen4"),
    ),
    Mutation(  # dots3's sliding layers given the causal prefix instead of their window
        "indexed_models_sliding_layers_see_the_prefix",
        "torch_impl/hf/inputs.py",
        "masks[SLIDING] = make_mask(context, padding, self.window, context.documents)",
        "masks[SLIDING] = make_mask(context, padding, None, context.documents)",
        ("parity_tests/hf/test_models.py", "-k", "family_equals and dots3"),
    ),
    Mutation(  # HY-V4's sinks dropped by the sparse attention (no gradient, other weights)
        "sparse_mla_drops_the_sinks",
        "torch_impl/hf/indexed.py",
        "scale=scaling, sinks=s_aux",
        "scale=scaling, sinks=None",
        ("parity_tests/hf/test_models.py", "-k", "family_equals and hy_v4"),
    ),
    Mutation(  # MLA's narrower value heads cut from the wrong end of the padded output
        "mla_values_cut_from_the_padding",
        "torch_impl/attention/kernels.py",
        "out[..., :Dv]",
        "out[..., width - Dv :]",
        ("parity_tests/hf/test_models.py", "-k", "family_equals and deepseek_v3"),
    ),
    Mutation(  # every model in the table said to isolate packed documents
        "every_listed_model_isolates_documents",
        "torch_impl/hf/documents.py",
        "dict.fromkeys(_NOT_ISOLATING.split(), False)",
        "dict.fromkeys(_NOT_ISOLATING.split(), True)",
        ("parity_tests/hf/test_hf.py", "-k", "packed_sequences_equal_one_process and gpt_oss"),
    ),
    Mutation(  # GRPO's and RLOO's completions table kept for every CP rank, not one per replica
        "completions_table_kept_for_every_cp_rank",
        "torch_impl/hf/rl.py",
        "for replica in every[:: t.cp_size]",
        "for replica in every",
        ("parity_tests/trainer/test_rl.py", "-k", "replicas_gathers"),
    ),
    Mutation(  # the mixin's rows padded to twice the layout's multiple (work and memory wasted)
        "rows_padded_to_twice_the_multiple",
        "torch_impl/hf/trainer.py",
        "multiple = self.cp_size * (2 if",
        "multiple = 2 * self.cp_size * (2 if",
        ("parity_tests/hf/test_whole_rows.py", "-k", "least_multiple"),
    ),
    Mutation(  # the replicas' mean returned as their sum (TRL 1.16 reduces with "sum" only)
        "replica_view_mean_is_the_sum",
        "torch_impl/hf/whole_rows.py",
        'return scale * (total / self._t.dp_size if reduction == "mean" else total)',
        "return scale * total",
        ("parity_tests/hf/test_whole_rows.py", "-k", "replica_view"),
    ),
    Mutation(  # the reward head's all-padding row not clamped to position 0 (a collator's last batch)
        "all_padding_row_not_clamped",
        "torch_impl/hf/heads.py",
        "position = last_position(input_ids != pad, group, layout=layout).clamp(min=0)",
        "position = last_position(input_ids != pad, group, layout=layout)",
        ("parity_tests/hf/test_hf_heads.py", "-x"),
    ),
    Mutation(  # a restatement run whatever the installed release's source: its digest never compared
        "restated_source_never_compared",
        "torch_impl/hf/upstream.py",
        "if found == recorded:",
        "if True:",
        ("parity_tests/hf/test_upstream.py", "-k", "parallelize_refuses_a_changed_lightning_attention"),
    ),
    Mutation(  # the chunk's transition applied transposed
        "state_map_transposed",
        "torch_impl/state.py",
        "torch.matmul(maps[:, c, ..., :m], states[-1])",
        "torch.matmul(maps[:, c, ..., :m].transpose(-1, -2), states[-1])",
        ("parity_tests/transport/test_state.py", "-k", "parity and 4-contiguous"),
    ),
    Mutation(  # each chunk given the state of the chunk before it (one map short)
        "state_from_the_chunk_before",
        "torch_impl/state.py",
        "mine = list(ShardPlan.of(layout, n, r, A.shape[1]).chunks)",
        "mine = [max(c - 1, 0) for c in ShardPlan.of(layout, n, r, A.shape[1]).chunks]",
        ("parity_tests/transport/test_state.py", "-k", "parity and 2-head_tail"),
    ),
    Mutation(  # a linear-attention layer's chunks given each other's states (head and tail swapped)
        "recurrent_state_misrouted",
        "torch_impl/hf/scans.py",
        "out = [correct(k, states[:, i]) for i, k in enumerate(kept)]",
        "out = [correct(k, states[:, -1 - i]) for i, k in enumerate(kept)]",
        ("parity_tests/hf/test_recurrent.py", "-k", "integer and 2-head_tail"),
    ),
    Mutation(  # every linear attention run from a zero state, as each rank alone would
        "recurrent_state_dropped",
        "torch_impl/hf/scans.py",
        "states = gather_state(torch.stack(decays, 1), torch.stack(maps, 1), group, layout=layout)",
        "states = torch.zeros_like(gather_state(torch.stack(decays, 1), torch.stack(maps, 1), group, "
        "layout=layout))",
        ("parity_tests/hf/test_hf.py", "-k", "float64 and qwen3_5-2"),
    ),
    Mutation(  # the conv in front of a linear attention without its kernel - 1 earlier inputs
        "recurrent_conv_without_halo",
        "torch_impl/hf/chunked.py",
        "reach = weight.shape[-1] - 1",
        "reach = 0",
        ("parity_tests/hf/test_hf.py", "-k", "float64 and qwen3_5-2"),
    ),
    Mutation(  # the CP forward without the forward's decorators (accelerate's offload hooks dropped)
        "rebound_forward_without_its_decorators",
        "torch_impl/hf/rebind.py",
        "    for wrapper in reversed(functions[:-1]):",
        "    for wrapper in ():",
        ("parity_tests/hf/test_rebind.py",),
    ),
    Mutation(  # a kernel package behind transformers' dispatcher taken for its PyTorch function
        "kernel_package_not_refused",
        "torch_impl/hf/rebind.py",
        'if found.get("is_new_implementation"):',
        "if False:",
        ("parity_tests/hf/test_rebind.py",),
    ),
    Mutation(  # packed rows: a Gated DeltaNet document's state not reset where it starts
        "recurrent_state_not_reset_at_a_document_start",
        "torch_impl/hf/chunked.py",
        "start[b : b + 1] if head and carried[b, 0] else torch.zeros_like(start[b : b + 1]),",
        "start[b : b + 1],",
        ("parity_tests/hf/test_hf.py", "-k", "packed_sequences_equal and qwen3_5-contiguous"),
    ),
    Mutation(  # packed rows: the earlier chunks' Mamba2 state reaching past a document start
        "mamba_state_past_a_document_start",
        "torch_impl/hf/scans.py",
        "reached = reached if split is None else reached * split[0][..., None]",
        "reached = reached",
        ("parity_tests/hf/test_hf.py", "-k", "packed_sequences_equal and bamba-contiguous"),
    ),
    Mutation(  # packed rows: the convs reading across a document start
        "recurrent_conv_across_a_document_start",
        "torch_impl/hf/documents.py",
        "keep = read[None] >= first[:, w.first_key : w.end, None]",
        "keep = read[None] >= 0 * first[:, w.first_key : w.end, None]",
        (
            "parity_tests/hf/test_hf.py",
            "-k",
            "packed_sequences_equal and (qwen3_5-contiguous or lfm2-contiguous)",
        ),
    ),
    Mutation(  # xLSTM: each chunk's stabiliser from zero, not one process's (the eps term moves)
        "mlstm_stabiliser_not_folded",
        "torch_impl/hf/mlstm.py",
        "m.append(torch.maximum(m[-1] + every[:, c, :, 0], every[:, c, :, 1]))",
        "m.append(torch.zeros_like(m[-1]))",
        ("parity_tests/hf/test_models.py", "-k", "family_equals and xlstm"),
    ),
    Mutation(  # xLSTM: the earlier chunks' memory not carried in
        "mlstm_state_dropped",
        "torch_impl/hf/mlstm.py",
        "true = (states[:, j, :, 0] * (-m).exp()).to(kept[0])",
        "true = (0 * states[:, j, :, 0] * (-m).exp()).to(kept[0])",
        ("parity_tests/hf/test_models.py", "-k", "family_equals and xlstm"),
    ),
    Mutation(  # the layer's transition read transposed
        "recurrent_transition_transposed",
        "torch_impl/hf/chunked.py",
        "return out, final[..., dv:], final[..., :dv]",
        "return out, final[..., dv:].transpose(-1, -2), final[..., :dv]",
        ("parity_tests/hf/test_recurrent.py", "-k", "random and gdn-4"),
    ),
    Mutation(  # a Mamba2 layer's chunks given each other's states (head and tail swapped)
        "mamba_state_misrouted",
        "torch_impl/hf/scans.py",
        "out = [correct(k, states[:, i]) for i, k in enumerate(kept)]",
        "out = [correct(k, states[:, -1 - i]) for i, k in enumerate(kept)]",
        ("parity_tests/hf/test_recurrent.py", "-k", "mamba2_integer and 2-head_tail"),
    ),
    Mutation(  # a Mamba2 chunk's decay applied one token late to the state it receives
        "mamba_decay_one_token_late",
        "torch_impl/hf/scans.py",
        "reached = (A.float() * step.float()).cumsum(dim=1).exp()",
        "reached = (A.float() * step.float()).cumsum(dim=1).roll(1, dims=1).exp()",
        ("parity_tests/hf/test_recurrent.py", "-k", "mamba2_random and contiguous"),
    ),
    Mutation(  # Mamba: a chunk corrected by the state of the rank's other chunk
        "selective_state_misrouted",
        "torch_impl/hf/scans.py",
        "out = [correct(k, states[:, i]) for i, k in enumerate(kept)]",
        "out = [correct(k, states[:, -1 - i]) for i, k in enumerate(kept)]",
        ("parity_tests/hf/test_recurrent.py", "-k", "selective_scan_integer and 2-head_tail"),
    ),
    Mutation(  # Mamba: the decay to each token of the state it receives applied one token late
        "selective_decay_one_token_late",
        "torch_impl/hf/scans.py",
        "return (y0, decay, C[..., rows]), a,",
        "return (y0, decay.roll(1, dims=2), C[..., rows]), a,",
        ("parity_tests/hf/test_recurrent.py", "-k", "selective_scan_random and contiguous"),
    ),
    Mutation(  # Zaya's projection: a chunk's outputs taken from the front, the halo's among them
        "cca_halo_outputs_kept",
        "torch_impl/hf/cca.py",
        "return tuple(t[:, -C:] for t in self.own(x, None, None))",
        "return tuple(t[:, :C] for t in self.own(x, None, None))",
        ("parity_tests/hf/test_models.py", "-k", "zaya"),
    ),
    Mutation(  # Zaya's projection: a document piece reads the tokens before its document's start
        "cca_across_a_document_start",
        "torch_impl/hf/cca.py",
        "begin = max(row[lo], w.start + lo - reach)",
        "begin = max(w.first_key, w.start + lo - reach)",
        ("parity_tests/hf/test_models.py", "-k", "zaya"),
    ),
    Mutation(  # mRoPE positions computed from each rank's own shard, not over the whole rows
        "mrope_positions_per_shard",
        "torch_impl/hf/media.py",
        "_positions(module, argument, ids, types, padding)  # [axes, B, S]\n"
        "    if positions is not None:  # the model's mRoPE over the whole rows: this rank's\n"
        '        changes["position_ids"] = positions[..., rows]  # [axes, B, L]',
        "_positions(module, argument, ids[:, rows], types[:, rows], None)\n"
        "    if positions is not None:\n"
        '        changes["position_ids"] = positions',
        ("parity_tests/hf/test_hf_media.py", "-k", "qwen2_vl-2-contiguous-False"),
    ),
    Mutation(  # the ranks' image features put together in the wrong order: another rank's images
        "image_features_to_the_wrong_rank",
        "torch_impl/hf/media.py",
        "for i in range(n)])  # [tokens, W]",
        "for i in reversed(range(n))])  # [tokens, W]",
        ("parity_tests/hf/test_hf_media.py", "-k", "llava-2-contiguous"),
    ),
]


def tracked_files():
    out = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    return [path for path in out.stdout.splitlines() if os.path.isfile(os.path.join(ROOT, path))]


def run(mutation, files):
    """(caught, what happened): the mutation's tests run on a mutated copy of the tree."""
    with tempfile.TemporaryDirectory(prefix="cp_mutation_") as tree:
        for path in files:
            os.makedirs(os.path.dirname(os.path.join(tree, path)) or tree, exist_ok=True)
            with open(os.path.join(ROOT, path), "rb") as src, open(os.path.join(tree, path), "wb") as dst:
                dst.write(src.read())
        target = os.path.join(tree, mutation.path)
        with open(target) as f:
            text = f.read()
        if text.count(mutation.old) != 1:
            return False, f"the text to change occurs {text.count(mutation.old)} times in {mutation.path}"
        with open(target, "w") as f:
            f.write(text.replace(mutation.old, mutation.new))
        env = {**os.environ, "PYTHONPATH": tree}  # the copy, not the installed tree
        where = subprocess.run(
            [sys.executable, "-c", "import torch_impl; print(torch_impl.__file__)"],
            cwd=tree,
            env=env,
            capture_output=True,
            text=True,
        ).stdout
        if not where.startswith(tree):
            return False, f"the copy's torch_impl was not the one imported ({where.strip()})"
        command = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *mutation.tests]
        try:
            proc = subprocess.run(
                command, cwd=tree, env=env, capture_output=True, text=True, timeout=TIMEOUT_S
            )
        except subprocess.TimeoutExpired:
            return True, f"the tests did not finish within {TIMEOUT_S} s (a hang)"
        last = (proc.stdout.strip().splitlines() or ["(no output)"])[-1]
        over = [
            line for line in proc.stdout.splitlines() if line.startswith("E") and "over its bound" in line
        ][:1]
        if proc.returncode == 1:
            return True, "; ".join([last, *(line.strip().removeprefix("E").strip() for line in over)])
        return False, f"pytest exit code {proc.returncode}: {last}"


def main(names):
    chosen = [m for m in MUTATIONS if not names or m.name in names]
    unknown = set(names) - {m.name for m in MUTATIONS}
    if unknown:
        raise SystemExit(f"unknown mutations {sorted(unknown)}; known: {[m.name for m in MUTATIONS]}")
    files, missed = tracked_files(), []
    for mutation in chosen:
        start = time.monotonic()
        caught, what = run(mutation, files)
        print(
            f"{'caught' if caught else 'MISSED'}  {mutation.name} ({time.monotonic() - start:.0f} s): {what}"
        )
        if not caught:
            missed.append(mutation.name)
    print(f"{len(chosen) - len(missed)} of {len(chosen)} mutations caught")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
