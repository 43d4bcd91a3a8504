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


def test_constants_sources_exist():
    for device in DEVICES.values():
        for field in ("bandwidth", "kernel_s", "host_to_device", "device_to_host", "host_overlap"):
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
        for field in ("host_to_device", "device_to_host"):
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
