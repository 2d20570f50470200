"""The CUDA tier: what runs only where a GPU is. `pytest -m cuda` runs these alone; `make gpu-check`
runs them, then one rank of `make bench-capacity` at Gemma-3-1B's shapes. Without CUDA every test
here is skipped with its reason, and the CPU suite is unchanged.

References are the exact CPU math on the same inputs: `torch_impl.attention` on the CPU (its tiles,
checked against the JAX reference and the models' dense masks by the CPU suite) in float64, on the
very values the CUDA inputs hold (rounded to their dtype first). Error: max |cuda - reference| /
max |reference|, per output and gradient, within TOLERANCE of its dtype: float32 1e-4 (fused
kernels reassociate, TF32 stays off), bfloat16 2e-2 (8 mantissa bits; the kernels accumulate in
float32).

Multi-rank CUDA runs need a GPU per rank (NCCL cannot run two ranks on one): one rank is played
through torch's fake process group (real buffers and kernels, no data moved: what it receives holds
whatever the memory held, so only rank 0's forward, which sees none of it, is compared with values).
"""

import contextlib
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from parity_tests.hf import hf_models
from torch_impl import attention, gather_halo, gather_metadata, gather_sequence
from torch_impl.attention import kernels

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

CUDA = torch.device("cuda")
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


def error(actual, expected):
    """max |actual - expected| / max |expected|, in float64 on the CPU."""
    actual, expected = actual.detach().double().cpu(), expected.detach().double().cpu()
    return ((actual - expected).abs().max() / expected.abs().max().clamp_min(1e-30)).item()


@pytest.fixture(autouse=True)
def _dynamo_room(monkeypatch):
    """flex_attention is compiled: every case here is a new mask (offsets and windows are constants
    of the graph); room for all of them, so that none falls back to eager (dense scores)."""
    import torch._dynamo.config as dynamo

    name = "recompile_limit" if hasattr(dynamo, "recompile_limit") else "cache_size_limit"
    monkeypatch.setattr(dynamo, name, 256)


@contextlib.contextmanager
def process_group(backend, rank, world_size):
    """The default process group for the block, destroyed after it (the suite's other tests run
    without one)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    store = FakeStore() if backend == "fake" else dist.HashStore()
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


# --- torch_impl.attention ------------------------------------------------------------------------

# (name, L, keys before the queries, window, documents, padding, soft-cap, sinks, the kernel in
# bfloat16)
ATTENTION_CASES = [
    ("global, first rank", 256, 0, None, False, False, None, False, "flash"),
    ("global, keys of three earlier ranks", 256, 768, None, False, False, None, False, "flash"),
    ("window inside the shard", 256, 63, 64, False, False, None, False, "flex"),
    ("window spanning three shards", 128, 299, 300, False, False, None, False, "flex"),
    ("documents", 256, 256, None, True, False, None, False, "flex"),
    ("window and documents", 256, 99, 100, True, False, None, False, "flex"),
    ("padding: queries that see nothing", 256, 0, None, False, True, None, False, "flex"),
    ("window and padding, offset", 128, 200, 150, False, True, None, False, "flex"),
    ("global, soft-capped (Gemma 2)", 256, 768, None, False, False, 2.0, False, "flex"),
    ("window, soft-capped, padding", 128, 200, 150, False, True, 2.0, False, "flex"),
    ("global, sinks (GPT-OSS)", 256, 768, None, False, False, None, True, "flex"),
    ("sinks, padding: a sink alone", 256, 0, None, False, True, None, True, "flex"),
    ("window, sinks, documents", 256, 99, 100, True, False, None, True, "flex"),
]


def attention_inputs(L, before, dtype, documents, padding, seed=0):
    """query [2, 4, L, 64], key and value [2, 2, before + L, 64] (GQA), the output's gradient, and
    documents / padding per key row (padding: row 0's first 40 keys, so its first queries of the
    first rank see nothing; row 1 none)."""
    gen = torch.Generator().manual_seed(seed)
    T = before + L
    q, k, v = (torch.randn(2, h, n, 64, generator=gen).to(dtype) for h, n in ((4, L), (2, T), (2, T)))
    grad = torch.randn(2, 4, L, 64, generator=gen).to(dtype)
    docs = torch.sort(torch.randint(0, 5, (2, T), generator=gen), dim=1).values if documents else None
    pad = None
    if padding:
        pad = torch.ones(2, T, dtype=torch.bool)
        pad[0, :40] = False
    return q, k, v, grad, docs, pad


def run_attention(
    device, dtype, q, k, v, grad, q_start, k_start, window, docs, pad, softcap=None, sinks=None
):
    """(out, dq, dk, dv[, dsinks]) of causal_attention on `device` in `dtype`."""
    tensors = (q, k, v) if sinks is None else (q, k, v, sinks)
    leaves = [t.to(device=device, dtype=dtype).requires_grad_() for t in tensors]
    docs, pad = (None if t is None else t.to(device) for t in (docs, pad))
    out = attention.causal_attention(
        *leaves[:3], q_start, k_start, window=window, documents=docs, padding=pad, softcap=softcap,
        sinks=None if sinks is None else leaves[3],
    )  # fmt: skip
    out.backward(grad.to(device=device, dtype=dtype))
    return (out, *(t.grad for t in leaves))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("case", ATTENTION_CASES, ids=[c[0] for c in ATTENTION_CASES])
def test_attention_on_cuda_equals_the_cpu_math(case, dtype, monkeypatch):
    """Forward and gradients of every row of the kernel table against the CPU tiles in float64;
    the kernel that ran is the one the table names (flash takes only 16-bit inputs: float32's
    global rows run on flex). Sinks: one logit per head, their gradient compared too."""
    name, L, before, window, documents, padding, softcap, with_sinks, kernel = case
    q, k, v, grad, docs, pad = attention_inputs(L, before, dtype, documents, padding)
    sinks = torch.linspace(-2, 3, 4).to(dtype) if with_sinks else None
    k_start = 0 if before == 0 else 500  # global rows of the first key
    q_start = k_start + before
    ran = []
    for key, fn in list(kernels._KERNELS.items()):
        monkeypatch.setitem(kernels._KERNELS, key, lambda *a, _k=key, _f=fn: ran.append(_k) or _f(*a))
    args = (q, k, v, grad, q_start, k_start, window, docs, pad, softcap, sinks)
    got = run_attention(CUDA, dtype, *args)
    expected = run_attention("cpu", torch.float64, *args)
    assert ran == [kernel if dtype == torch.bfloat16 else "flex"]
    for label, a, b in zip(("out", "dq", "dk", "dv", "dsinks"), got, expected, strict=True):
        assert a.dtype == dtype and a.device.type == "cuda"
        assert error(a, b) <= TOLERANCE[dtype], (label, error(a, b))
    if padding and before == 0:  # row 0's queries 0..39 see only padding: zeros
        assert got[0][0, :, :40].abs().max().item() == 0


def test_flash_kernel_runs_for_global_layers():
    """The flash row is PyTorch's flash kernel itself (by the profiler's kernel names), and flex
    rows run no flash kernel."""
    from torch.profiler import ProfilerActivity, profile

    q, k, v, grad, _, _ = attention_inputs(256, 256, torch.bfloat16, False, False)

    def kernels(window):
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            run_attention(CUDA, torch.bfloat16, q, k, v, grad, 256, 0, window, None, None)
            torch.cuda.synchronize()
        return [e.name.lower() for e in prof.events() if e.device_type.name == "CUDA"]

    assert any("flash" in name for name in kernels(None))
    assert not any("flash" in name for name in kernels(64))


@pytest.mark.parametrize("window", [None, 512], ids=["global", "window"])
def test_attention_builds_no_dense_mask(window):
    """At L = T = 32768 a dense [L, T] bool mask alone is 1 GiB and bfloat16 scores of 2 heads 4
    GiB; the forward+backward's peak above its inputs stays within 16 inputs' size + 64 MiB."""
    L, dtype = 32768, torch.bfloat16
    q = torch.randn(1, 2, L, 64, device=CUDA, dtype=dtype, requires_grad=True)
    k = torch.randn(1, 1, L, 64, device=CUDA, dtype=dtype, requires_grad=True)
    v = torch.randn(1, 1, L, 64, device=CUDA, dtype=dtype, requires_grad=True)
    grad = torch.randn_like(q)
    attention.causal_attention(q, k, v, 0, 0, window=window).backward(grad)  # compiles, warms up
    q.grad = k.grad = v.grad = None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    attention.causal_attention(q, k, v, 0, 0, window=window).backward(grad)
    torch.cuda.synchronize()
    rise = torch.cuda.max_memory_allocated() - base
    assert rise <= 16 * q.nbytes + 64 * 2**20, f"{rise / 2**20:.0f} MiB"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_sparse_mla_attention_on_cuda_equals_the_cpu_math(dtype):
    """DeepSeek Sparse Attention's absorbed attention at GLM-5's head dimensions (nope 192, rope
    64, v 256, latents of 512): some picks not visible, a query that sees none."""
    gen = torch.Generator().manual_seed(0)
    B, H, L, T, k, r, dn, dr, dv = 2, 4, 200, 600, 32, 512, 192, 64, 256
    query = torch.randn(B, H, L, dn + dr, generator=gen).to(dtype)
    latents = torch.randn(B, T, r + dr, generator=gen).to(dtype)
    weight = (torch.randn(H * (dn + dv), r, generator=gen) / r**0.5).to(dtype)
    indices = torch.randint(0, T, (B, L, k), generator=gen, dtype=torch.int32)
    valid = torch.rand(B, L, k, generator=gen) < 0.8
    valid[0, 7] = False
    grad = torch.randn(B, L, H, dv, generator=gen).to(dtype)

    def run(device, work):
        leaves = [t.to(device=device, dtype=work).requires_grad_() for t in (query, latents, weight)]
        out = attention.sparse_mla_attention(
            *leaves, indices.to(device), valid.to(device), nope_dim=dn, scale=(dn + dr) ** -0.5
        )
        out.backward(grad.to(device=device, dtype=work))
        return (out, *(t.grad for t in leaves))

    got, expected = run(CUDA, dtype), run("cpu", torch.float64)
    for label, a, b in zip(("out", "d query", "d latents", "d kv_weight"), got, expected, strict=True):
        assert a.dtype == dtype and a.device.type == "cuda"
        assert error(a, b) <= TOLERANCE[dtype], (label, error(a, b))
    assert got[0][0, 7].abs().max().item() == 0


# --- the transport on CUDA tensors ----------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_transport_on_cuda_through_the_fake_group(dtype):
    """Rank 3 of 4 (L = 16): every function's shapes, dtype and device, its own rows exactly (in both
    layouts), the left padding's zeros, gradients of the input's shape, and no host synchronization
    (a copy to the host would raise under the sync debug mode)."""
    L, n, r = 16, 4, 3
    x = torch.randn(2, L, 3, 8, device=CUDA, dtype=dtype, requires_grad=True)
    positions = torch.arange(r * L, (r + 1) * L, device=CUDA).expand(2, L)
    mask = torch.ones(2, L, dtype=torch.bool, device=CUDA)
    with process_group("fake", r, n) as group:
        torch.cuda.set_sync_debug_mode("error")
        try:
            full = gather_sequence(x, group)  # [2, n*L, 3, 8]
            halos = {h: gather_halo(x, group, h) for h in (0, 5, 16, 40)}  # 40: three earlier ranks
            padded = gather_halo(x, group, 5, left_padding=3)
            # head_tail: chunks 3 and 4 of C = 8; windows of 5 and of 20 (from chunks 3, 2 and 1)
            balanced = (
                gather_sequence(x, group, layout="head_tail"),
                gather_halo(x, group, 20, layout="head_tail"),
            )
            balanced[0].sum().backward(retain_graph=True)
            meta = gather_metadata(positions, group), gather_metadata(mask, group)
            (full.sum() + sum(y.sum() for y in halos.values()) + padded.sum()).backward()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert full.shape == (2, n * L, 3, 8) and full.dtype == dtype and full.device.type == "cuda"
    assert torch.equal(full[:, r * L :], x)
    for h, y in halos.items():
        assert y.shape == (2, h + L, 3, 8) and y.dtype == dtype and y.device.type == "cuda"
        assert torch.equal(y[:, h:], x)
    assert padded.shape == (2, 3 + 5 + L, 3, 8) and padded[:, :3].abs().max().item() == 0
    assert torch.equal(padded[:, 8:], x)
    assert meta[0].shape == meta[1].shape == (2, n * L)
    assert meta[0].dtype == torch.int64 and torch.equal(meta[0][:, r * L :], positions)
    assert meta[1].dtype == torch.bool and bool(meta[1][:, r * L :].all())
    assert x.grad.shape == x.shape and x.grad.device.type == "cuda"
    C = L // 2
    assert balanced[0].shape == (2, n * L, 3, 8)
    assert torch.equal(balanced[0][:, 3 * C : 4 * C], x[:, :C]) and torch.equal(
        balanced[0][:, 4 * C : 5 * C], x[:, C:]
    )
    assert balanced[1].shape == (2, (20 + C) * 2, 3, 8)  # both chunks' windows are full
    assert torch.equal(balanced[1][:, 20 : 20 + C], x[:, :C]) and torch.equal(balanced[1][:, -C:], x[:, C:])
    assert torch.equal(
        balanced[1][:, 20 + C + 20 - C : 20 + C + 20], x[:, :C]
    )  # chunk 4's window ends with chunk 3


def test_transport_without_cp_on_one_nccl_rank():
    """A world of one NCCL rank: every function returns its input itself, as on the CPU."""
    x = torch.randn(2, 16, 8, device=CUDA)
    positions = torch.arange(16, device=CUDA).expand(2, 16)
    with process_group("nccl", 0, 1) as group:
        assert gather_sequence(x, group) is x
        assert gather_halo(x, group, 5) is x
        assert gather_metadata(positions, group) is positions


# --- torch_impl.hf on CUDA models -----------------------------------------------------------------

FAMILIES = hf_models.SUPPORTED + hf_models.INDEXED


def cuda_model(name, dtype):
    return hf_models.build(name, dtype, head_dim=16).to(CUDA)


# head_tail's DSA layers gather the whole sequence: under the fake group most of it is whatever the
# memory held, which the head's masked picks would still multiply (by zero, but NaN * 0 is NaN)
FIRST_RANK = [(name, "contiguous") for name in FAMILIES]
FIRST_RANK += [(name, "head_tail") for name in FAMILIES if name not in hf_models.INDEXED]


@pytest.mark.parametrize("name,layout", FIRST_RANK)
def test_hf_first_rank_equals_the_model_on_cuda(name, layout):
    """Rank 0 of 4 in float32 through the fake group: the logits of its first chunk (contiguous:
    its whole shard; head_tail: its head) equal the model's own on those tokens alone (causal:
    they see nothing another rank holds), with a row padded on the left."""
    from torch_impl import hf

    batch = {key: t.to(CUDA) for key, t in hf_models.make_batch(left=True).items()}
    C = hf_models.SEQ_LEN // 4 // (1 if layout == "contiguous" else 2)
    plain = cuda_model(name, torch.float32)
    expected = plain(
        input_ids=batch["input_ids"][:, :C], attention_mask=batch["attention_mask"][:, :C], use_cache=False
    ).logits
    model = cuda_model(name, torch.float32)
    with process_group("fake", 0, 4) as group:
        hf.parallelize(model, group, layout=layout, validate=False, verbose=False)
        logits = model(**hf.shard_batch(batch, group, layout=layout)).logits[:, :C]
    assert logits.shape == expected.shape and logits.device.type == "cuda"
    tokens = batch["attention_mask"][:, :C].bool()  # padding rows' outputs are nobody's
    assert error(logits[tokens], expected[tokens]) <= TOLERANCE[torch.float32]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("name", FAMILIES)
def test_hf_last_rank_runs_on_cuda(name, dtype, monkeypatch):
    """Rank 3 of 4 (the most keys) through the fake group, forward and backward under activation
    checkpointing, without and with padding: shapes, the path each layer kind takes, and which
    kernels torch_impl.attention ran (flash for global layers of 16-bit rows without padding)."""
    from torch_impl import hf

    ran = []
    for key, fn in list(kernels._KERNELS.items()):
        monkeypatch.setitem(kernels._KERNELS, key, lambda *a, _k=key, _f=fn: ran.append(_k) or _f(*a))
    model = cuda_model(name, dtype)
    model.train()
    with process_group("fake", 3, 4) as group:
        hf.parallelize(model, group, validate=False, verbose=False)
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=hf.checkpoint_kwargs())
        for pad in (0, 5):  # without an attention_mask, then with a row padded
            batch = {key: t.to(CUDA) for key, t in hf_models.make_batch(pad=pad).items()}
            if not pad:
                del batch["attention_mask"]
            out = model(**hf.shard_batch(batch, group))
            out.loss.backward()
            assert out.logits.shape == (2, hf_models.SEQ_LEN // 4, hf_models.VOCAB)
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert all(g is not None and g.device.type == "cuda" for g in grads)
    dense = [m.context_parallel.fallback for m in model.modules() if hasattr(m, "context_parallel")]
    assert set(dense) == {None}
    if name in hf_models.INDEXED:
        assert ran == []
    else:
        assert set(ran) <= {"flash", "flex"} and "tiled" not in ran and ran
        if dtype == torch.float32:
            assert set(ran) == {"flex"}
        elif name == "llama":  # global layers only: flash without padding, flex with it
            assert set(ran) == {"flash", "flex"}


# --- the main job on one GPU ----------------------------------------------------------------------


def test_train_with_nccl_on_one_gpu_equals_one_process(tmp_path):
    """`examples.train --cp 1` under torchrun, one rank on NCCL, against one process: EQUAL."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1"]
    command += ["-m", "examples.train", "--cp", "1", "--reference", "--steps", "3", "--seq-len", "512"]
    command += ["--metrics", str(tmp_path / "m.json"), "--figure", str(tmp_path / "f.png")]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, env=os.environ)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "float32, nccl: 1 rank" in done.stdout and "EQUAL" in done.stdout, done.stdout[-3000:]
