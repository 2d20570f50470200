"""The JAX reference against the brute-force statements in `expected`, forward and VJP, exactly.

Integer-valued data: every value and every sum is exact, so equality is exact. With n devices and
L = 3, device r holds global tokens [3r, 3r + 3).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_reference
from parity_tests.harness import expected, jax_harness

L = 3
WORLDS = [1, 2, 3, 4, 8]
SHAPES = [(1, ()), (2, (3,))]  # (batch, trailing dims)


def halo_sizes(n):
    return sorted({0, 1, L - 1, L, L + 1, 2 * L + 1, (n - 1) * L, n * L + 5})


def cases():
    for n in WORLDS:
        for halo_size in halo_sizes(n):
            for left_padding in (0, 2):
                for batch, trailing in SHAPES:
                    yield n, halo_size, left_padding, batch, trailing


def unpad(static_out, torch_len):
    """The last `torch_len` positions of a static-shape JAX output; asserts the rest is zero."""
    front = static_out.shape[1] - torch_len
    assert not static_out[:, :front].any()
    return static_out[:, front:]


@pytest.mark.parametrize("n,halo_size,left_padding,batch,trailing", list(cases()))
def test_gather_halo_forward_and_vjp(n, halo_size, left_padding, batch, trailing):
    x = expected.stamped((batch, n * L, *trailing), np.float32)
    static_len = left_padding + min(halo_size, (n - 1) * L) + L
    rng = np.random.default_rng(n * 1000 + halo_size)
    cotangent = expected.small_ints(rng, (n, batch, static_len, *trailing), np.float32)

    y, grad = jax_harness.run("gather_halo", x, n, cotangent, halo_size=halo_size, left_padding=left_padding)

    want = expected.halo_forward(x, n, halo_size, left_padding)
    assert y.shape == (n, batch, static_len, *trailing) and y.dtype == np.float32
    for r in range(n):
        np.testing.assert_array_equal(unpad(y[r], want[r].shape[1]), want[r])
    # Cotangents at the always-zero front positions have nowhere to go: they are dropped.
    visible = [cotangent[r][:, static_len - want[r].shape[1] :] for r in range(n)]
    want_grad = expected.halo_backward(visible, n, L, halo_size, left_padding, np.float32)
    np.testing.assert_array_equal(grad, want_grad)


@pytest.mark.parametrize("n", WORLDS)
@pytest.mark.parametrize("batch,trailing", SHAPES)
def test_gather_sequence_forward_and_vjp(n, batch, trailing):
    x = expected.stamped((batch, n * L, *trailing), np.float32)
    cotangent = expected.small_ints(np.random.default_rng(n), (n, batch, n * L, *trailing), np.float32)

    y, grad = jax_harness.run("gather_sequence", x, n, cotangent)

    assert y.shape == (n, batch, n * L, *trailing)
    for r in range(n):
        np.testing.assert_array_equal(y[r], x)
    np.testing.assert_array_equal(grad, expected.sequence_backward(list(cotangent)))


@pytest.mark.parametrize("n", WORLDS)
@pytest.mark.parametrize("dtype", [np.bool_, np.int32])
def test_gather_metadata_bool_and_int(n, dtype):
    x = (expected.stamped((2, n * L), np.int32) % 3 == 0).astype(dtype)
    y, _ = jax_harness.run("gather_metadata", x, n)
    assert y.dtype == dtype
    for r in range(n):
        np.testing.assert_array_equal(y[r], x)


def test_gather_metadata_has_no_gradient():
    n = 4
    x = expected.stamped((1, n * L, 2), np.float32)
    cotangent = np.ones((n, 1, n * L, 2), np.float32)
    _, grad = jax_harness.run("gather_metadata", x, n, cotangent)
    assert not grad.any()


def test_jax_grad_of_a_loss_through_halo_and_sequence():
    """jax.grad (not only jax.vjp) works, under jit, on an axis with another name."""
    n = 4
    mesh = jax.make_mesh((n,), ("ring",), devices=jax.devices()[:n])
    spec = jax.sharding.PartitionSpec(None, "ring")

    def loss(x):
        def per_device(x):
            halo = jax_reference.gather_halo(x, "ring", halo_size=4, left_padding=1)
            full = jax_reference.gather_sequence(x, "ring")
            return jax.lax.psum(halo.sum() + 0.5 * full.sum(), "ring")

        return jax.shard_map(per_device, mesh=mesh, in_specs=spec, out_specs=jax.sharding.PartitionSpec())(x)

    x = expected.stamped((1, n * L), np.float32)
    with jax.set_mesh(mesh):
        grad = np.asarray(jax.jit(jax.grad(loss))(jax.device_put(x, jax.NamedSharding(mesh, spec))))
    # Each token counts once locally, once per later halo that holds it, and 0.5 per device's gather.
    ones = [np.ones((1, 1 + expected.halo_len(r, L, 4) + L), np.float32) for r in range(n)]
    want = expected.halo_backward(ones, n, L, 4, 1, np.float32) + 0.5 * n
    np.testing.assert_array_equal(grad, want)


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda x: jax_reference.gather_halo(x, "cp", -1), "`halo_size` must be a non-negative int, got -1"),
        (
            lambda x: jax_reference.gather_halo(x, "cp", 2.0),
            "`halo_size` must be a non-negative int, got 2.0",
        ),
        (
            lambda x: jax_reference.gather_halo(x, "cp", 2, -3),
            "`left_padding` must be a non-negative int, got -3",
        ),
        (
            lambda x: jax_reference.gather_halo(x, "cp", 2, lookahead=(1, -1)),
            "`lookahead` must be a non-negative int, got -1",
        ),
        (lambda x: jax_reference.gather_halo(x[0], "cp", 2), r"`x` must be \[batch, local_sequence, ...\]"),
        (lambda x: jax_reference.gather_sequence(x[0], "cp"), r"ndim >= 2\), got shape \(3,\)"),
        (lambda x: jax_reference.gather_metadata(x[0], "cp"), r"ndim >= 2\), got shape \(3,\)"),
    ],
)
def test_bad_arguments_raise_value_error(call, match):
    x = jnp.zeros((1, 3))
    with pytest.raises(ValueError, match=match):
        call(x)


# --- layouts ---------------------------------------------------------------------------------


def head_tail_cases():
    for n in (1, 2, 3, 4):
        for halo_size in sorted({0, 1, 2, 3, 4, 7, (2 * n - 1) * 2, 4 * n + 3}):  # C = 2: 1-3+ chunks
            yield n, halo_size, 1 if halo_size % 2 else 0


@pytest.mark.parametrize("n,halo_size,left_padding", list(head_tail_cases()))
def test_head_tail_layout_forward_and_vjp(n, halo_size, left_padding):
    """Device r holds chunks r and 2n-1-r (C = 2 tokens): gather_sequence and gather_metadata give
    the global order; gather_halo each chunk's own window (zeros in front to the static length);
    gradients reach the owners. Inputs and gradients travel in device order."""
    C, L = 2, 4
    x = expected.stamped((2, n * L, 3), np.float32)  # global order
    xd = expected.device_order(x, n, "head_tail")
    layout = {"layout": "head_tail"}
    static = [
        left_padding + min(halo_size, (n - 1) * C) + C,
        left_padding + min(halo_size, (2 * n - 1) * C) + C,
    ]
    rng = np.random.default_rng(n * 100 + halo_size)
    ct = expected.small_ints(rng, (n, 2, sum(static), 3), np.float32)

    y, grad = jax_harness.run(
        "gather_halo", xd, n, ct, halo_size=halo_size, left_padding=left_padding, **layout
    )
    want = expected.layout_halo_forward(x, n, halo_size, left_padding, "head_tail")
    visible = []
    for r in range(n):
        lens = [left_padding + h + C for h, _ in expected.halo_segments(n, L, r, halo_size, "head_tail")]
        got_parts, ct_parts = [], []
        for k, start in enumerate((0, static[0])):
            got_parts.append(unpad(y[r][:, start : start + static[k]], lens[k]))
            ct_parts.append(ct[r][:, start + static[k] - lens[k] : start + static[k]])
        np.testing.assert_array_equal(np.concatenate(got_parts, axis=1), want[r])
        visible.append(np.concatenate(ct_parts, axis=1))
    want_grad = expected.layout_halo_backward(visible, n, L, halo_size, left_padding, "head_tail", np.float32)
    np.testing.assert_array_equal(grad, expected.device_order(want_grad, n, "head_tail"))

    cts = expected.small_ints(rng, (n, 2, n * L, 3), np.float32)
    y, grad = jax_harness.run("gather_sequence", xd, n, cts, **layout)
    for r in range(n):
        np.testing.assert_array_equal(y[r], x)
    np.testing.assert_array_equal(grad, expected.device_order(cts.sum(0), n, "head_tail"))
    y, _ = jax_harness.run("gather_metadata", xd.astype(np.int32), n, **layout)
    for r in range(n):
        np.testing.assert_array_equal(y[r], x.astype(np.int32))


def test_per_chunk_halo_worked_example():
    """The module docstring's per-chunk example: n=3, L=2, halo_size=(0, 1, 3); a wrong count of
    halo sizes is refused."""
    y, _ = jax_harness.run("gather_halo", np.arange(6, dtype=np.float32)[None] + 1, 3, halo_size=(0, 1, 3))
    assert (y[:, 0] - (y[:, 0] > 0)).tolist() == [[0, 0, 0, 0, 1], [0, 0, 1, 2, 3], [1, 2, 3, 4, 5]]
    with pytest.raises(ValueError, match=r"one per global chunk \(3\), got \(0, 1\)"):
        jax_harness.run("gather_halo", np.ones((1, 6), np.float32), 3, halo_size=(0, 1))


def test_head_tail_worked_example():
    """The module docstring's example: n=2, L=2, halo_size=2."""
    y, _ = jax_harness.run(
        "gather_halo", np.array([[0, 3, 1, 2]], np.float32), 2, halo_size=2, layout="head_tail"
    )
    assert y[:, 0].tolist() == [[0, 0, 1, 2, 3], [0, 1, 0, 1, 2]]


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda x: jax_reference.gather_halo(x, "cp", 1, layout="zigzag"), "`layout` must be one of"),
        (
            lambda x: jax_reference.gather_sequence(x, "cp", layout="head_tail"),
            "needs an even local_sequence",
        ),
    ],
)
def test_bad_layouts_raise_value_error(call, match):
    with pytest.raises(ValueError, match=match):
        call(jnp.zeros((1, 3)))


def definition_cases():
    rng = np.random.default_rng(0)
    for n in (1, 2, 3, 4):
        for layout, L in (("contiguous", 3), ("head_tail", 4)):
            chunks = n * (2 if layout == "head_tail" else 1)
            for halo_size in (0, 1, 5, 2 * n * L, tuple(int(h) for h in rng.integers(0, 2 * L, chunks))):
                yield n, layout, L, halo_size, 1 if n % 2 else 0, 0
            # a lookahead: one token, past the next chunk, past the end, one per chunk
            for lookahead in (1, L + 1, 2 * n * L, tuple(int(a) for a in rng.integers(0, 2 * L, chunks))):
                yield n, layout, L, 2, 0, lookahead


@pytest.mark.parametrize("n,layout,L,halo_size,left_padding,lookahead", list(definition_cases()))
def test_gather_halo_is_its_definition(n, layout, L, halo_size, left_padding, lookahead):
    """The ppermute implementation gives, on every device, the global tokens halo_rows names, zeros
    at -1; and every token's gradient is the sum of the cotangents at the positions naming it."""
    x = expected.stamped((2, n * L, 3), np.float32)  # global order
    kwargs = dict(halo_size=halo_size, left_padding=left_padding, layout=layout, lookahead=lookahead)
    rows = [jax_reference.halo_rows(n, L, r, **kwargs) for r in range(n)]
    ct = expected.small_ints(np.random.default_rng(n), (n, 2, len(rows[0]), 3), np.float32)
    y, grad = jax_harness.run("gather_halo", expected.device_order(x, n, layout), n, ct, **kwargs)
    want_grad = np.zeros_like(x)
    for r in range(n):
        held = np.array(rows[r])
        np.testing.assert_array_equal(y[r], np.where(held[None, :, None] >= 0, x[:, held], 0))
        np.add.at(want_grad, (slice(None), held[held >= 0]), ct[r][:, held >= 0])
    np.testing.assert_array_equal(grad, expected.device_order(want_grad, n, layout))
