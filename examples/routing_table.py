"""Which global tokens each device's `gather_halo` and `gather_sequence` outputs hold, per the JAX reference.

Runs `jax_reference` on simulated CPU devices. Each input token carries its global position + 1, so
an output value v > 0 is token v - 1 and 0 is a zero (shown as `.`).

    python -m examples.routing_table [--world 4] [--local-len 3] [--halo-size 4] [--left-padding 1]
"""

import argparse
import os


def _fmt(row, cell):
    return " ".join(("." if v == 0 else str(int(v) - 1)).rjust(cell) for v in row)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--local-len", type=int, default=3)
    parser.add_argument("--halo-size", type=int, default=4)
    parser.add_argument("--left-padding", type=int, default=1)
    args = parser.parse_args(argv)
    flag = f"--xla_force_host_platform_device_count={args.world}"
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flag}".strip()

    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P
    import numpy as np

    import jax_reference

    n, L = args.world, args.local_len
    mesh = jax.make_mesh((n,), ("cp",), devices=jax.devices()[:n])

    def per_device(x):
        halo = jax_reference.gather_halo(x, "cp", args.halo_size, args.left_padding)
        return halo[None], jax_reference.gather_sequence(x, "cp")[None]

    tokens = np.arange(1, n * L + 1, dtype=np.float32)[None]  # x: f32[1, n*L], token t holds t + 1
    with jax.set_mesh(mesh):
        fn = jax.shard_map(per_device, in_specs=P(None, "cp"), out_specs=(P("cp"), P("cp")))
        halo, full = map(np.asarray, fn(jax.device_put(tokens, NamedSharding(mesh, P(None, "cp")))))

    print(
        f"JAX reference on {n} simulated devices: L={L}, halo_size={args.halo_size}, "
        f"left_padding={args.left_padding} (numbers are global token positions, . is a zero)"
    )
    cell = len(str(n * L - 1))
    width = max(len(_fmt(halo[0, 0], cell)), len("gather_halo"))
    print(f"{'device':>6}  {'owns':<12}  {'gather_halo':<{width}}  gather_sequence")
    for r in range(n):
        owns = f"[{r * L}, {(r + 1) * L})"
        print(f"{r:>6}  {owns:<12}  {_fmt(halo[r, 0], cell):<{width}}  {_fmt(full[r, 0], cell)}")


if __name__ == "__main__":
    main()
