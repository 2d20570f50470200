"""Bytes a rank receives per DeepSeek Sparse Attention layer under CP, at the released models' sizes.

    python -m benchmarks.dsa_bytes [--n 8] [--local-len 16384] [--item 2] [--coverage]

The sizes are transformers' own defaults of `DeepseekV32Config` and `GlmMoeDsaConfig` (DeepSeek
V3.2's and GLM-5's released dimensions). On rank r of n, L tokens each, per layer, forward and
backward (the tests count the same formula at the c10d calls, at their own sizes):

  torch_impl.hf   forward: the causal prefix's MLA latents (kv_lora_rank + rope dims a token) and
                  indexer keys (index_head_dim), r*L tokens; backward: the latents' gradients of
                  this rank's L tokens from each of the n-1-r later ranks
  all-gather K/V  forward: the expanded per-head K and V (heads x (qk_nope + qk_rope + v dims)) of
                  (n-1)*L tokens, and the same indexer keys; backward: a reduce-scatter, (n-1)*L

`--coverage`: how much of its causal prefix a rank's queries select, i.e. what a transport of only
the selected latents would move against the prefix: examples.train's DeepSeek V3.2 (random weights)
on the standard library's text, one process, the indexer's top-k captured per layer.
"""

import argparse

import torch

from cp_support import results
from cp_support.minima import indexed_layer_bytes


def coverage(seq_len, n, topk):
    """{(layer, rank): the share of rank r's r*L earlier tokens that its queries select}."""
    from cp_support.corpus import Corpus
    from cp_support.models import build_model

    model = build_model("deepseek_v32", seq_len, topk, torch.float32)
    model.eval()
    chosen = {}
    for i, layer in enumerate(model.model.layers):
        layer.self_attn.indexer.register_forward_hook(lambda m, args, out, i=i: chosen.update({i: out[0]}))
    with torch.no_grad():
        model(input_ids=Corpus(seq_len).batch(0, 1)["input_ids"], use_cache=False)
    L, shares = seq_len // n, {}
    for i, indices in chosen.items():  # [S, k] global key rows per query
        for r in range(1, n):
            picks = indices[r * L : (r + 1) * L].flatten()
            shares[(i, r)] = picks[picks < r * L].unique().numel() / (r * L)
    return shares


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--local-len", type=int, default=16384)
    p.add_argument("--item", type=int, default=2, help="bytes per value (2: bfloat16)")
    p.add_argument("--coverage", action="store_true")
    p.add_argument("--json", default="out/dsa_bytes.json")
    args = p.parse_args(argv)
    import transformers as tf

    if args.coverage:
        rows = []
        for seq_len, n, topk in ((2048, 4, 64), (2048, 4, 256), (2048, 8, 256)):
            shares = sorted(coverage(seq_len, n, topk).values())
            rows.append(
                {"S": seq_len, "n": n, "topk": topk, "min": shares[0], "median": shares[len(shares) // 2]}
            )
            print(
                f"S={seq_len}, n={n}, index_topk={topk}: the selected share of the prefix, per layer and "
                f"rank: min {rows[-1]['min']:.3f}, median {rows[-1]['median']:.3f}"
            )
        results.write(args.json, args, rows)
        return rows

    n, L, item = args.n, args.local_len, args.item
    print(f"n = {n} ranks, L = {L} tokens per rank (S = {n * L}), {item} bytes a value; per layer and step")
    header = f"{'model':<15}{'latent':>7}{'K/V':>7}  {'rank':<10}{'torch_impl':>14}"
    print(f"{header}{'all-gather K/V':>16}{'ratio':>8}")
    rows = []
    for name, config in (("DeepSeek V3.2", tf.DeepseekV32Config()), ("GLM-5", tf.GlmMoeDsaConfig())):
        per_rank = [indexed_layer_bytes(config, n, L, r, item) for r in range(n)]
        latent = config.kv_lora_rank + config.qk_rope_head_dim
        expanded = config.num_attention_heads * (
            config.qk_nope_head_dim + config.qk_rope_head_dim + config.v_head_dim
        )
        for label, pick in (("largest", max), ("all ranks", sum)):
            ours = pick(b[("torch_impl", "forward")] + b[("torch_impl", "backward")] for b in per_rank)
            base = pick(b[("allgather", "forward")] + b[("allgather", "backward")] for b in per_rank)
            print(f"{name:<15}{latent:>7}{expanded:>7}  {label:<10}{ours:>14,}{base:>16,}{ours / base:>8.4f}")
            rows.append({"model": name, "ranks": label, "torch_impl": ours, "allgather": base})
    results.write(args.json, args, rows)
    return rows


if __name__ == "__main__":
    main()
