"""A decode step's time on a GPU (or this CPU), modelled from its compiled program and measured device constants.

step = device bytes / attainable bandwidth + kernels × per-kernel cost + host → device bytes / link bandwidth
+ device → host bytes / link bandwidth. The terms add (serial) unless the device's ``host_overlap`` says a measured
trace showed host transfers hidden behind device work; then the host term only counts where it exceeds the device
terms. The bytes-only bound that :mod:`kvjax.evals.plan` projects (bytes at the nominal HBM bandwidth) leaves out the
kernels and the host link; held against the committed H100 / H200 runs it was several times too fast
(``docs/results/cost_model_backtest.md``).

Counted from the compiled (optimized) HLO of the step:

* device bytes: :func:`kvjax.evals.plan.hlo_bytes` (each kernel's operands and output in device memory);
* kernels: :func:`kvjax.evals.plan.kernel_launches`: every instruction that launches work on the device (fusions,
  custom calls such as Pallas kernels and the start of a host call, copies, unfused ops), loop bodies times their known
  trip count, a conditional's largest branch; none for bookkeeping (parameters, tuples, bitcasts, the ``*-done`` half
  of an async pair), for a host computation's work or for zero-sized arrays;
* host transfers (:func:`host_transfers`): a host call (``HostExecute`` custom call) reads its operands that lie in
  device memory (device → host) and returns its results to device memory (host → device); a copy between host
  (``S(5)``) and device memory moves its array once in its direction; a device kernel that reads an operand in host
  memory pulls those bytes over the link (host → device) and one whose output lies in host memory pushes it
  (device → host).

Every device constant is in :data:`DEVICES`, each with the committed file it comes from (``docs/GPU.md``, "The cost
model", shows the table). The CPU's entry has no host link (``host_to_device`` / ``device_to_host`` None): host and
device are the same memory, so its step is memory bytes / bandwidth + kernels (XLA:CPU ops) × per-op cost; a program
that moved bytes over a host link cannot be modelled on it (:func:`step_time` refuses).
"""

from __future__ import annotations

import dataclasses
import re

from kvjax.evals.hlo import memory_bytes


@dataclasses.dataclass(frozen=True)
class DeviceConstants:
    """One device's measured constants; ``sources`` names, per field, the committed files the value comes from."""

    name: str
    bandwidth: float  # attainable device-memory bytes/s (measured probe)
    kernel_s: float  # seconds per kernel launched (fitted on the device's committed step times)
    host_to_device: float | None  # bytes/s over the host link, host -> device (measured); None: no link (a CPU)
    device_to_host: float | None  # bytes/s, device -> host; None: no link
    host_overlap: bool  # True only where a measured trace shows host transfers hidden behind device work
    sources: dict


H100_PROBES = ("docs/results/bench_heterocache_synckv_recall_qwen2.5-coder-0.5b_h100.md",
               "docs/results/bench_locret_qwen2.5-coder-0.5b_h100.md",
               "docs/results/bench_recall_schedules_qwen2.5-coder-0.5b_h100.md",
               "docs/results/bench_recall_scheduler_qwen2.5-coder-0.5b_h100.md",
               "docs/results/bench_recall_xla_default_qwen2.5-coder-0.5b_h100.md",
               "docs/results/bench_recall_spread_qwen2.5-coder-0.5b_h100.md",
               "docs/results/bench_recall_spread_sorted_qwen2.5-coder-0.5b_h100.md",
               "docs/results/bench_recall_without_reanchor_qwen2.5-coder-0.5b_h100.md")
H200_PROBES = ("docs/results/bench_heterocache_synckv_recall_qwen2.5-coder-0.5b_h200.md",
               "docs/results/bench_locret_qwen2.5-coder-0.5b_h200.md")
H100_LINK = ("docs/results/microbench/recall_step_h100.md", "docs/results/microbench/recall_step_deps_h100.md",
             "docs/results/microbench/recall_step_scheduler_h100.md")
BACKTEST = "docs/results/cost_model_backtest.json"
OVERLAP_TRACE = "docs/results/profile_recall_scheduler_h100/step_anatomy.md"

CPU_PROBES = ("docs/results/bench_methods_qwen2.5-coder-0.5b.md", "docs/results/bench_methods_smollm2-135m.md",
              "docs/results/bench_heterocache_synckv_qwen2.5-coder-0.5b.md")
CPU_BACKTEST = "docs/results/cost_model_backtest_cpu.json"

# bandwidth: the median of the runs' read probes (jitted jnp.sum over 1 GiB, "machine read bandwidth"); host link:
# the median "GB/s of the extra" of the microbenchmarks' `always` rows (a layer's whole recall every step, no
# conditional), no device -> host probe is committed, so that direction takes the same figure; kernel_s: the
# back-test's fit on the device's runs whose compiled step moves nothing over the host link; host_overlap: the
# profiled recall steps waited on their host calls (step_anatomy.md: 10.7-12.7 of 16.5-19.0 host-call ms waiting)
DEVICES = {
    "h100": DeviceConstants(
        "h100", bandwidth=2182.45e9, kernel_s=1.99e-6, host_to_device=15.555e9, device_to_host=15.555e9,
        host_overlap=False,
        sources={"bandwidth": H100_PROBES, "kernel_s": (BACKTEST,), "host_to_device": H100_LINK,
                 "device_to_host": H100_LINK, "host_overlap": (OVERLAP_TRACE,)}),
    # no H200 link probe is committed: both GPUs' host links are PCIe Gen5 x16, so the H100's figures stand in
    "h200": DeviceConstants(
        "h200", bandwidth=1994.55e9, kernel_s=1.16e-6, host_to_device=15.555e9, device_to_host=15.555e9,
        host_overlap=False,
        sources={"bandwidth": H200_PROBES, "kernel_s": (BACKTEST,), "host_to_device": H100_LINK,
                 "device_to_host": H100_LINK, "host_overlap": (OVERLAP_TRACE,)}),
    # the project's 2-core CPU machine (Intel Xeon, XLA:CPU, float32): bandwidth the median of its back-tested runs'
    # read probes (26.2 / 23.0 / 30.3 GB/s: the qwen bench_methods run's 26.2); per op (an XLA:CPU kernel: fusion,
    # copy, unfused op) fitted on both models' bench_methods runs (kvjax.evals.cost_backtest --cpu); no host link:
    # host and device are the same memory
    "cpu": DeviceConstants(
        "cpu", bandwidth=26.2e9, kernel_s=22.67e-6, host_to_device=None, device_to_host=None, host_overlap=False,
        sources={"bandwidth": CPU_PROBES, "kernel_s": (CPU_BACKTEST,)}),
}


def host_transfers(hlo: str) -> dict:
    """Bytes a compiled (optimized) HLO module moves over the host link per run, ``{"host_to_device": ...,
    "device_to_host": ...}``, by the rule in the module docstring, as often as each instruction runs."""
    from kvjax.evals.plan import walked_instructions

    h2d = d2h = 0
    dones = None
    for inst, times, on_host, host_bytes, by_name in walked_instructions(hlo):
        if on_host:  # a host computation's own work stays in host memory
            continue
        if inst.op == "custom-call-start" and 'custom_call_target="HostExecute"' in inst.tail:
            if dones is None:
                dones = {i.operands[0]: i for i in by_name.values() if i.op == "custom-call-done" and i.operands}
            done = dones.get(inst.name)
            d2h += times * sum(memory_bytes(by_name[o].shape)[0] for o in inst.operands if o in by_name)
            h2d += times * (memory_bytes(done.shape)[0] if done is not None else 0)
            continue
        if inst.op == "copy-start":  # (destination, source, context)
            found = re.match(r"\((\S+), (\S+), [su]32\[\]", inst.shape)
            if found:
                dst, src = memory_bytes(found.group(1)), memory_bytes(found.group(2))
                h2d += times * min(dst[0], src[1])
                d2h += times * min(dst[1], src[0])
            continue
        # any other device kernel: its host-memory output is pushed, the rest of its host bytes (the slices it
        # reads of host arrays, as hlo_bytes counts them) pulled
        written = times * memory_bytes(inst.shape)[1]
        d2h += written
        h2d += max(host_bytes - written, 0)
    return {"host_to_device": h2d, "device_to_host": d2h}


@dataclasses.dataclass(frozen=True)
class StepCounts:
    """What the model reads off one compiled step."""

    device_bytes: float
    kernels: int
    host_to_device: float = 0
    device_to_host: float = 0


def count_step(hlo: str) -> StepCounts:
    """:class:`StepCounts` of a compiled (optimized) HLO module."""
    from kvjax.evals.plan import hlo_bytes, kernel_launches

    link = host_transfers(hlo)
    return StepCounts(hlo_bytes(hlo)["device"], kernel_launches(hlo), link["host_to_device"], link["device_to_host"])


def step_time(counts: StepCounts, device: DeviceConstants) -> dict:
    """The modelled step in seconds, by term: ``bytes_s``, ``kernels_s``, ``host_s`` and ``step_s`` (their sum, or the
    device terms and the host term's excess over them where ``device.host_overlap``), with ``overlap``."""
    bytes_s = counts.device_bytes / device.bandwidth
    kernels_s = counts.kernels * device.kernel_s
    if device.host_to_device is None or device.device_to_host is None:  # one memory: nothing crosses a link
        if counts.host_to_device or counts.device_to_host:
            raise ValueError(f"{device.name} has no host link, but the program moves "
                             f"{counts.host_to_device} / {counts.device_to_host} bytes over one")
        host_s = 0.0
    else:
        host_s = counts.host_to_device / device.host_to_device + counts.device_to_host / device.device_to_host
    device_s = bytes_s + kernels_s
    step = max(device_s, host_s) if device.host_overlap else device_s + host_s
    return {"bytes_s": bytes_s, "kernels_s": kernels_s, "host_s": host_s, "step_s": step,
            "overlap": device.host_overlap}


ASSUMPTIONS = ("modelled step = device bytes / attainable bandwidth + kernels × per-kernel cost + host-link bytes "
               "(both directions) / measured link bandwidth, serial (no measured trace shows the host transfers "
               "hidden); constants per GPU in `kvjax.evals.cost_model.DEVICES`: measured bandwidth probes and host "
               "link, a per-kernel cost fitted on the committed H100 / H200 step times")
CPU_ASSUMPTIONS = ("modelled step = memory bytes / measured read bandwidth + XLA:CPU kernels × per-op cost (no host "
                   "link: host and device are the same memory); constants in `kvjax.evals.cost_model.DEVICES['cpu']`: "
                   "the median read probe of the back-tested runs, a per-op cost fitted on committed CPU step times")


__all__ = ["DeviceConstants", "DEVICES", "StepCounts", "host_transfers", "count_step", "step_time", "ASSUMPTIONS", "CPU_ASSUMPTIONS"]
