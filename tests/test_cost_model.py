"""The step-time cost model (kvjax.evals.cost_model) on a hand-made compiled program, and its constants' sources."""

import json
import os
import re
import statistics

import pytest

from kvjax.evals import cost_model
from kvjax.evals.cost_model import DEVICES, DeviceConstants, StepCounts, count_step, host_transfers, step_time
from kvjax.evals.plan import hlo_bytes, kernel_launches

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A recall-shaped GPU step: a matrix-vector fusion over device weights; a host call gathering 128 rows of a pinned-host
# pool (S(5)) at device indices and returning them to device memory; a fusion over those rows; a kernel slicing 16 rows
# straight out of the host pool; an async copy of the fusion's output to host memory.
HLO = """HloModule step

%fused_mv (a: f32[1024,256], b: f32[256]) -> f32[1024] {
  %a = f32[1024,256]{1,0} parameter(0)
  %b = f32[256]{0} parameter(1)
  ROOT %d = f32[1024]{0} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%host_gather (p: bf16[4096,64], i: s32[128]) -> bf16[128,64] {
  %p = bf16[4096,64]{1,0} parameter(0)
  %i = s32[128]{0} parameter(1)
  ROOT %g = bf16[128,64]{1,0} gather(%p, %i), offset_dims={1}, collapsed_slice_dims={0}, start_index_map={0}, index_vector_dim=1, slice_sizes={1,64}
}

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %z = f32[] add(%x, %y)
}

%fused_rows (r: bf16[128,64]) -> f32[64] {
  %r = bf16[128,64]{1,0} parameter(0)
  %c = f32[128,64]{1,0} convert(%r)
  %zero = f32[] constant(0)
  ROOT %s = f32[64]{0} reduce(%c, %zero), dimensions={0}, to_apply=%add
}

%fused_ds (q: bf16[4096,64], k: s32[]) -> bf16[16,64] {
  %q = bf16[4096,64]{1,0:S(5)} parameter(0)
  %k = s32[] parameter(1)
  %z = s32[] constant(0)
  ROOT %ds = bf16[16,64]{1,0} dynamic-slice(%q, %k, %z), dynamic_slice_sizes={16,64}
}

ENTRY %main (w: f32[1024,256], x: f32[256], hp: bf16[4096,64], idx: s32[128], at: s32[]) -> (f32[64], bf16[16,64], f32[1024]) {
  %w = f32[1024,256]{1,0} parameter(0)
  %x = f32[256]{0} parameter(1)
  %hp = bf16[4096,64]{1,0:S(5)} parameter(2)
  %idx = s32[128]{0} parameter(3)
  %at = s32[] parameter(4)
  %mv = f32[1024]{0} fusion(%w, %x), kind=kLoop, calls=%fused_mv
  %hc = ((bf16[4096,64]{1,0:S(5)}, s32[128]{0}), bf16[128,64]{1,0}, u32[]) custom-call-start(%hp, %idx), async_execution_thread="host", custom_call_target="HostExecute", called_computations={%host_gather}
  %rows = bf16[128,64]{1,0} custom-call-done(%hc)
  %sum = f32[64]{0} fusion(%rows), kind=kInput, calls=%fused_rows
  %direct = bf16[16,64]{1,0} fusion(%hp, %at), kind=kLoop, calls=%fused_ds
  %cs = (f32[1024]{0:S(5)}, f32[1024]{0}, u32[]) copy-start(%mv)
  %cd = f32[1024]{0:S(5)} copy-done(%cs)
  ROOT %out = (f32[64]{0}, bf16[16,64]{1,0}, f32[1024]{0:S(5)}) tuple(%sum, %direct, %cd)
}
"""

MV = 1024 * 256 * 4 + 256 * 4 + 1024 * 4  # reads w and x, writes the product
HOST_CALL = 128 * 4 + (128 * 4 + 128 * 64 * 2 + 4)  # its device operand, its start's device arrays (hlo_bytes' rule)
ROWS = 128 * 64 * 2 + 64 * 4  # reads the returned rows, writes the sums
DIRECT = 4 + 16 * 64 * 2  # reads its index, writes the 16 rows (read from host memory: host bytes)
COPY = 1024 * 4  # the copy's device side
RETURNED = 128 * 64 * 2  # host -> device: the host call's result
PULLED = 16 * 64 * 2  # host -> device: the rows the kernel slices out of the host pool
PUSHED = 128 * 4 + 1024 * 4  # device -> host: the host call's device operand, the copy to host memory


def test_counts_of_a_hand_made_program():
    assert hlo_bytes(HLO)["device"] == MV + HOST_CALL + ROWS + DIRECT + COPY
    assert kernel_launches(HLO) == 5  # two fusions, the host call's start, the slicing fusion, the copy's start
    assert host_transfers(HLO) == {"host_to_device": RETURNED + PULLED, "device_to_host": PUSHED}
    assert count_step(HLO) == StepCounts(MV + HOST_CALL + ROWS + DIRECT + COPY, 5, RETURNED + PULLED, PUSHED)


def _device(overlap: bool) -> DeviceConstants:
    return DeviceConstants("test", bandwidth=1e9, kernel_s=2e-6, host_to_device=1e8, device_to_host=5e7,
                           host_overlap=overlap, sources={})


def test_step_time_by_hand():
    counts = count_step(HLO)
    device_bytes = MV + HOST_CALL + ROWS + DIRECT + COPY
    serial = step_time(counts, _device(False))
    assert serial["bytes_s"] == pytest.approx(device_bytes / 1e9)
    assert serial["kernels_s"] == pytest.approx(5 * 2e-6)
    assert serial["host_s"] == pytest.approx((RETURNED + PULLED) / 1e8 + PUSHED / 5e7)
    assert serial["step_s"] == pytest.approx(device_bytes / 1e9 + 10e-6 + (RETURNED + PULLED) / 1e8 + PUSHED / 5e7)
    assert serial["overlap"] is False
    hidden = step_time(counts, _device(True))  # the host term counts only past the device terms
    assert hidden["step_s"] == pytest.approx(max(device_bytes / 1e9 + 10e-6, (RETURNED + PULLED) / 1e8 + PUSHED / 5e7))
    # with nothing on the host link the model is bytes plus kernels whatever the flag says
    plain = StepCounts(3e9, 100)
    assert step_time(plain, _device(True))["step_s"] == step_time(plain, _device(False))["step_s"] == \
        pytest.approx(3.0 + 200e-6)


def _linked(device) -> bool:
    return device.host_to_device is not None


def test_constants_sources_exist():
    for device in DEVICES.values():
        fields = ("bandwidth", "kernel_s") + (("host_to_device", "device_to_host", "host_overlap") if _linked(device) else ())
        for field in fields:
            assert device.sources.get(field), (device.name, field)
            for path in device.sources[field]:
                assert os.path.isfile(os.path.join(ROOT, path)), path


def _median_of(paths, pattern):
    values = []
    for path in paths:
        with open(os.path.join(ROOT, path)) as f:
            values += [float(v) for v in re.findall(pattern, f.read(), re.M)]
    assert values
    return statistics.median(values)


def test_constants_are_their_sources_figures():
    """Each constant is what its files say: the median bandwidth probe, the median `always` link rate, the
    back-test's fitted per-kernel cost."""
    for device in DEVICES.values():
        assert device.bandwidth == pytest.approx(
            1e9 * _median_of(device.sources["bandwidth"], r"machine read bandwidth ([0-9.]+) GB/s"), rel=1e-6)
        for field in ("host_to_device", "device_to_host") if _linked(device) else ():
            assert getattr(device, field) == pytest.approx(
                1e9 * _median_of(device.sources[field], r"^\| always \|(?: kvjax \|| xla-default \|)?(?: [^|]* \|){4} ([0-9.]+) \|$"),
                rel=1e-6)
        with open(os.path.join(ROOT, device.sources["kernel_s"][0])) as f:
            fitted = json.load(f)["fits"][device.name]
        assert device.kernel_s == pytest.approx(fitted, abs=0.005e-6)
        assert device.host_overlap is False


def test_assumptions_name_the_terms():
    for term in ("bandwidth", "kernels", "host", "serial"):
        assert term in cost_model.ASSUMPTIONS


# A CPU step: a matrix-vector fusion over the weights, an unfused add, a copy (XLA:CPU memory only, no host space).
CPU_HLO = """HloModule cpu_step

%fused_mv (a: f32[512,128], b: f32[128]) -> f32[512] {
  %a = f32[512,128]{1,0} parameter(0)
  %b = f32[128]{0} parameter(1)
  ROOT %d = f32[512]{0} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main (w: f32[512,128], x: f32[128], y: f32[512]) -> (f32[512], f32[512]) {
  %w = f32[512,128]{1,0} parameter(0)
  %x = f32[128]{0} parameter(1)
  %y = f32[512]{0} parameter(2)
  %mv = f32[512]{0} fusion(%w, %x), kind=kOutput, calls=%fused_mv
  %sum = f32[512]{0} add(%mv, %y)
  %cp = f32[512]{0} copy(%sum)
  ROOT %out = (f32[512]{0}, f32[512]{0}) tuple(%sum, %cp)
}
"""
CPU_BYTES = (512 * 128 * 4 + 128 * 4 + 512 * 4) + 3 * 512 * 4 + 2 * 512 * 4  # fusion, add, copy: operands + output


def test_cpu_projection_by_hand():
    """On the CPU (no host link) the step is memory bytes / bandwidth + kernels × per-op cost, nothing else."""
    counts = count_step(CPU_HLO)
    assert counts == StepCounts(CPU_BYTES, 3, 0, 0)
    cpu = DEVICES["cpu"]
    assert cpu.host_to_device is None and cpu.device_to_host is None
    modelled = step_time(counts, cpu)
    assert modelled["bytes_s"] == pytest.approx(CPU_BYTES / cpu.bandwidth)
    assert modelled["kernels_s"] == pytest.approx(3 * cpu.kernel_s)
    assert modelled["host_s"] == 0
    assert modelled["step_s"] == pytest.approx(CPU_BYTES / cpu.bandwidth + 3 * cpu.kernel_s)
    made_up = DeviceConstants("cpu-test", bandwidth=2e10, kernel_s=1e-5, host_to_device=None, device_to_host=None,
                              host_overlap=False, sources={})
    assert step_time(counts, made_up)["step_s"] == pytest.approx(CPU_BYTES / 2e10 + 3e-5)
    with pytest.raises(ValueError, match="no host link"):  # one memory: a program moving link bytes is not a CPU's
        step_time(StepCounts(1e6, 3, 4096, 0), made_up)


def test_cpu_fit_recovers_a_known_per_op_cost():
    """Rows made by the model itself with a known per-op cost: the fit on either model's rows finds it, every modelled
    row is exact, and a contention row (measured far slower) is left out of the fit."""
    from kvjax.evals import cost_backtest as bt

    bandwidth, per_op = 25e9, 23e-6
    rows = []
    for model, run in (("qwen2.5-coder-0.5b", bt.CPU_FIT_RUNS[0]), ("smollm2-135m", bt.CPU_FIT_RUNS[1])):
        for i, (gib, kernels) in enumerate([(1.9, 660), (2.0, 850), (2.2, 1100), (0.5, 820), (0.6, 1400)]):
            device_bytes = gib * 2**30
            rows.append({"file": run, "model": model, "note": "", "device_bytes": device_bytes, "kernels": kernels,
                         "host_to_device": 0, "device_to_host": 0,
                         "measured_s": device_bytes / bandwidth + kernels * per_op})
    assert bt.fit_kernel_s(rows, bandwidth) == pytest.approx(per_op, rel=1e-9)
    rows.append({"file": bt.CPU_FIT_RUNS[0], "model": "qwen2.5-coder-0.5b", "note": "contention", "device_bytes": 2e9,
                 "kernels": 800, "host_to_device": 0, "device_to_host": 0, "measured_s": 0.5})
    report = bt.cpu_backtest(rows, bandwidth)
    for fitted in ("qwen2.5-coder-0.5b", "smollm2-135m", "cpu"):
        assert report["fits"][fitted] == pytest.approx(per_op, rel=1e-9), fitted
    for r in rows[:-1]:
        for label in ("own", "other", "both"):
            assert r[f"model_{label}"]["step_s"] == pytest.approx(r["measured_s"], rel=1e-9)
        assert r["bytes_only_s"] == pytest.approx(r["device_bytes"] / bandwidth)
    assert not rows[-1]["fit_row"]
    assert report["summary"]["both bench_methods, fit rows"]["both"]["max"] == pytest.approx(0, abs=1e-9)
    # a second per-op cost on the other model: each model's own fit finds its own
    for r in rows[:-1]:
        if r["model"] == "smollm2-135m":
            r["measured_s"] = r["device_bytes"] / bandwidth + r["kernels"] * 2 * per_op
    report = bt.cpu_backtest(rows, bandwidth)
    assert report["fits"]["qwen2.5-coder-0.5b"] == pytest.approx(per_op, rel=1e-9)
    assert report["fits"]["smollm2-135m"] == pytest.approx(2 * per_op, rel=1e-9)


def test_cpu_rows_rebuilt_or_skipped_with_a_reason():
    from kvjax.evals import cost_backtest as bt

    assert bt.method_options("SnapKV(budget=0.1, gqa='mean', groups=(1, 8), window=32)") == {
        "budget": "0.1", "gqa": "'mean'", "groups": "(1, 8)", "window": "32"}
    method, why = bt.rebuilt_method("snapkv", 0.1, "SnapKV(budget=0.1, page_size=16, gqa='mean', block=256, "
                                    "implementation='auto', window=32, accumulate=False, kernel=7, pooling='max')")
    assert method is not None and why is None  # a dropped staging option is no part of the decode step
    method, why = bt.rebuilt_method("snapkv", 0.1, "SnapKV(budget=0.1, page_size=32, gqa='mean', block=256, "
                                    "implementation='auto', window=32, kernel=7, pooling='max')")
    assert method is None and "page_size 32 -> 16" in why
    # an option added since the run (here: lookahead) at its default keeps the row; at another value it does not
    method, why = bt.rebuilt_method("snapkv", 0.1, "SnapKV(budget=0.1, page_size=16, gqa='mean', block=256, "
                                    "implementation='auto', window=32, kernel=7, pooling='max')")
    assert method is not None and why is None
    method, why = bt.rebuilt_method("snapkv:lookahead=4", 0.1, "SnapKV(budget=0.1, page_size=16, gqa='mean', "
                                    "block=256, implementation='auto', window=32, kernel=7, pooling='max')")
    assert method is None and "added lookahead=4" in why
