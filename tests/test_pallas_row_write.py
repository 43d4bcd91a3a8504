"""The in-place row-write kernel (:mod:`kvjax.pallas_kernels.row_write`) against numpy: its GPU form (interpreted on a CPU,
compiled on a GPU) and its XLA form, on the edges a recall step hits (rows dropped past a pool, negative slots, a pool with no rows,
pools of different sizes), and its errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.pallas_kernels.row_write import write_rows

SIZES = (70, 5, 0, 3)
# on a CPU the kernel's GPU form runs interpreted, on a GPU compiled (``scripts/gpu_checks.sh kernels``); a TPU has none
KERNEL = {"cpu": "pallas_interpret", "gpu": "pallas"}.get(jax.default_backend())


def _form(implementation: str) -> str:
    """``"xla"``, or for ``"kernel"`` the kernel's form on this platform (skipped on a TPU, which has none)."""
    if implementation == "kernel" and KERNEL is None:
        pytest.skip("the kernel has no TPU form")
    return KERNEL if implementation == "kernel" else implementation


def _case():
    rng = np.random.default_rng(0)
    pools = [rng.normal(size=(n, 64)).astype(np.float32) for n in (96, 160, 8, 16)]
    rows = rng.normal(size=(sum(SIZES), 64)).astype(np.float32)
    slots = np.r_[rng.permutation(96)[:68], -1, 96,  # pool 0: 68 rows, one negative slot, one just past the pool
                  3, 159, 200, 0, 7,  # pool 1: one slot past it
                  15, 0, -5].astype(np.int32)  # pool 3 (pool 2 has none)
    return pools, rows, slots


def _numpy(pools, rows, slots):
    out, at = [p.copy() for p in pools], 0
    for pool, size in zip(out, SIZES):
        for r in range(at, at + size):
            if 0 <= slots[r] < pool.shape[0]:
                pool[slots[r]] = rows[r]
        at += size
    return out


@pytest.mark.parametrize("implementation", ["xla", "kernel"])
def test_rows_land_at_their_slots_and_nothing_else_changes(implementation):
    implementation = _form(implementation)
    pools, rows, slots = _case()
    bf16 = [jnp.asarray(p, jnp.bfloat16) for p in pools]
    fn = jax.jit(lambda p, r, s: write_rows(p, r, s, SIZES, implementation=implementation), donate_argnums=(0,))
    got = fn(bf16, jnp.asarray(rows), jnp.asarray(slots))  # float32 rows into bfloat16 pools: cast
    as_bf16 = lambda x: np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32))
    want = _numpy([as_bf16(p) for p in pools], as_bf16(rows), slots)
    for g, w in zip(got, want):
        assert g.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(g.astype(jnp.float32)), w)
    # the case writes something into every pool with rows and drops rows (so a no-op would fail)
    assert sum(int((np.asarray(g.astype(jnp.float32)) != as_bf16(p)).any(-1).sum()) for g, p in zip(got, pools)) == 68 + 4 + 2


@pytest.mark.parametrize("implementation", ["xla", "kernel"])
def test_no_rows_leave_the_pools_as_they_are(implementation):
    implementation = _form(implementation)
    pools = [jnp.arange(16 * 64, dtype=jnp.float32).reshape(16, 64), jnp.ones((8, 64))]
    got = write_rows(pools, jnp.zeros((0, 64)), jnp.zeros((0,), jnp.int32), (0, 0), implementation=implementation)
    for g, p in zip(got, pools):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(p))


def test_bad_calls_raise():
    pools, rows, slots = _case()
    pools = [jnp.asarray(p) for p in pools]
    with pytest.raises(ValueError, match="one size per pool"):
        write_rows(pools, rows, slots, SIZES[:3])
    with pytest.raises(ValueError, match="rows must be"):
        write_rows(pools, rows[:-1], slots, SIZES)
    with pytest.raises(ValueError, match="slots must be int"):
        write_rows(pools, rows, slots.astype(np.float32), SIZES)
    with pytest.raises(ValueError, match="not \\[N, D=64\\]"):
        write_rows(pools[:3] + [jnp.zeros((16, 32))], rows, slots, SIZES)
    with pytest.raises(ValueError, match="implementation"):
        write_rows(pools, rows, slots, SIZES, implementation="triton")
    with pytest.raises(NotImplementedError, match="no TPU form"):
        write_rows(pools, rows, slots, SIZES, implementation="pallas", backend="tpu")
