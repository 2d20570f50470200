"""The main job: a transformers hybrid LM trained with DP x CP under torchrun, equal to one process.

    torchrun --standalone --nproc-per-node 4 -m examples.train --cp 4 --reference
    torchrun --standalone --nproc-per-node 2 -m examples.train --dp 2 --cp 1   (pure data parallelism)
    python -m examples.train --reference                                        (one process)
    torchrun ... -m examples.train --dp D --cp C --steps N --seq-len S --model M [--reference]
        M: gemma3 (default), lfm2, deepseek_v32
    two nodes: on each, torchrun --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d \
                   --rdzv-endpoint HOST:PORT -m examples.train --dp 2 --cp 2 ...

What it does, in order:
1. Process group (gloo on CPU; NCCL with one GPU per rank when CUDA is available) and the mesh
   `init_device_mesh(device, (D, C), mesh_dim_names=("dp", "cp"))`.
2. The model, from a config with a fixed seed (no downloads): `gemma3` (default) is Gemma 3's text
   model with its 5:1 layout of sliding-window and global layers, the window reaching back over
   more than one CP shard; `lfm2` is LFM2's short convolutions with global attention;
   `deepseek_v32` is DeepSeek V3.2's sparse attention (MLA, an indexer choosing `--window` keys per
   query; MoE) in every layer. Vocabulary 256: the tokens are bytes.
3. Parallelized in torchtitan's order: CP (`hf.parallelize(model, mesh["cp"])`), activation
   checkpointing (`--ac`, with `hf.checkpoint_kwargs()`), per-layer
   `torch.compile(fullgraph=True)` (`--compile`), FSDP2.
   FSDP2 (`hf.apply_fsdp`, `fully_shard`) shards every decoder layer and the root over the
   flattened dp x cp mesh, with gradient divide factor 1 (`global_num_items=True`): each rank's
   loss is already its share of the global mean (`num_items_in_batch` counts the valid labels of
   all DP batches), so the summed gradients are exactly the one-process gradients. FSDP2 is exact
   on gloo (its reduce-scatter sums in the parameters' dtype, as one process's backward does).
4. Data: the standard library's own `.py` files, sorted by name, as bytes; step k's batch is the
   rows k*D*B .. (k+1)*D*B - 1 of S tokens each, DP rank d taking B of them.
5. AdamW with gradient clipping; a progress bar and one log line per step (step, loss, tokens/s).
   `--save-dir DIR --save-every K` checkpoints model, optimizer, step and data position with
   torch.distributed.checkpoint; `--resume` continues from the latest checkpoint there.
6. Before training, one extra forward+backward per transport (not a training step) counts the
   bytes each rank receives per step, per layer, through this library and through the baseline that
   all-gathers K and V in every attention layer (cp_support/allgather.py; `--transport allgather`
   trains with it instead). Counted without activation checkpointing: with `--ac` in eager mode
   the backward's recomputation repeats each layer's forward exchange (compiled, it keeps them).
7. `--reference`: rank 0 then trains the same model from the same seed on the same data in one
   process (the D batches as one batch, no CP) and prints per step both losses and their
   difference, how far apart the trained parameters ended, peak resident memory per rank,
   tokens/s, bytes per step, and the figure out/loss_curves.png. Exit status 1 if any step's
   losses differ by more than the tolerance:

   Tolerance. transformers computes the loss in float32 whatever the model's dtype
   (`ForCausalLMLoss` upcasts the logits with `.float()`), and Gemma 3's and LFM2's RMS norms
   too: one process sums D*B*S token losses in float32, CP sums n partial sums and adds them, so
   the two losses differ by float32 rounding of the sum even in float64: torch adds a float32 sum
   pairwise (cascade), within log2(N) u of the sum of its N positive terms each (u = 2^-24), the
   two sums 2 log2(N) u |loss| apart; and the float32 norms round the (float64-equal) hidden states
   of the two runs to float32 values that may differ by an ulp. float64: 1e-5 (2 * 10 * 2^-24 * 8:
   up to 1024 tokens a step, losses up to 8; measured 2.4e-7, one ulp at a loss of 4). float32:
   the whole model rounds, differently in the two runs (attention sums in another order), and
   AdamW amplifies early rounding differences (its first updates are lr * g/|g|: a gradient
   component near zero whose rounding differs moves its parameter by up to a full lr in the other
   direction); measured here: at most 1.1e-6 on the loss over 20 steps, parameters apart by about
   1e-4 of their tensor's largest entry; 1e-4 on the loss leaves a margin for longer runs.
   `deepseek_v32` makes discrete choices from float32 scores (the indexer's top-k keys, the MoE
   router's top-2 experts, both computed in float32 whatever the dtype): a float32 rounding
   difference between the two runs can flip a near-tied choice, and the runs part slowly
   (measured at --seq-len 512 --window 64, 10 steps: dp 2 x cp 2 7.2e-7; cp 4 3.3e-5 at step 10,
   growing). In float64 the scores'
   inputs agree to float64 rounding and no choice flips: EQUAL (4.8e-7 over 4 steps).

Modules: `cli` (arguments, process groups, the mesh: `main`), `parallel` (the parallelisms, in
order), `loop` (one `step`, the DP x CP run and the one-process reference), `checkpoint`, `report`
(bytes, memory, speed, the verdict and the figure). Its models and data: `cp_support.models`,
`cp_support.corpus`.
"""
