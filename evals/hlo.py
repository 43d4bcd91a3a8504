"""One reader of XLA's HLO text, for every compiled-program check (:mod:`kvjax.evals.plan`: bytes and kernels per
step; :mod:`kvjax.evals.gpu_schedule`: where host calls sit in a scheduled GPU program)."""

from __future__ import annotations

import dataclasses
import math
import re

_COMPUTATION = re.compile(r"^(?:ENTRY )?%(\S+) \(")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%(\S+) = (.+?) ([a-z][a-z0-9-]*)\((.*)$")
ARRAY = re.compile(r"\b(f32|bf16|f16|s32|u32|s8|u8|u16|s16|pred|s64|u64|f64)\[([0-9,]*)\](\{[^}]*\})?")
DTYPE_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "s8": 1, "u8": 1, "u16": 2, "s16": 2, "pred": 1,
               "s64": 8, "u64": 8, "f64": 8}


@dataclasses.dataclass
class Instruction:
    """One HLO instruction: ``%name = shape op(args) tail``."""

    name: str
    shape: str
    op: str
    operands: list  # names of the instructions it reads, in order
    args: str  # the text between the parentheses
    tail: str  # attributes after them
    root: bool


def parse_module(hlo: str) -> dict[str, list[Instruction]]:
    """Computations of an HLO module, in program order: name -> its instructions."""
    comps, current = {}, None
    for line in hlo.splitlines():
        head = _COMPUTATION.match(line)
        if head:
            current = comps.setdefault(head.group(1), [])
            continue
        if line.startswith("}"):
            current = None
            continue
        inst = _INSTRUCTION.match(line) if current is not None else None
        if inst:
            rest = inst.group(4)
            depth, end = 1, len(rest)
            for i, ch in enumerate(rest):
                depth += (ch == "(") - (ch == ")")
                if depth == 0:
                    end = i
                    break
            args = rest[:end]
            current.append(Instruction(inst.group(1), inst.group(2), inst.group(3), re.findall(r"%([\w.\-]+)", args),
                                       args, rest[end:], line.lstrip().startswith("ROOT ")))
    return comps


def memory_bytes(shape: str) -> tuple[int, int]:
    """(device memory bytes, host bytes) of the arrays of an HLO shape: ``S(5)`` in a layout is host memory, ``S(1)``
    a TPU core's on-chip memory (VMEM: neither)."""
    dev = host = 0
    for dtype, dims, layout in ARRAY.findall(shape):
        n = DTYPE_BYTES[dtype] * math.prod(int(d) for d in dims.split(",") if d)
        if layout and "S(5)" in layout:
            host += n
        elif not (layout and "S(1)" in layout):
            dev += n
    return dev, host


def shape_bytes(shape: str) -> int:
    """Bytes of every array in an HLO shape string, wherever it lives (a tuple counts all its elements)."""
    return sum(DTYPE_BYTES[dtype] * math.prod(int(d) for d in dims.split(",") if d)
               for dtype, dims, _ in ARRAY.findall(shape))


def loop_bodies(hlo: str) -> set[str]:
    """Names of the computations that are ``while`` loop bodies."""
    return set(re.findall(r"\bbody=%(\S+?)[,}\s]", hlo))


def branch_computations(hlo: str) -> set[str]:
    """Names of the computations that are a ``conditional``'s branches."""
    branches = set()
    for m in re.finditer(r"branch_computations=\{([^}]*)\}", hlo):
        branches.update(name.strip().lstrip("%") for name in m.group(1).split(","))
    branches.update(re.findall(r"(?:true|false)_computation=%(\S+?)[,}\s]", hlo))
    return branches


def custom_call_operands(hlo: str, target: str) -> list[list[str]]:
    """Per custom call to ``target`` (``tpu_custom_call``, ``mosaic_gpu_v2``), its operand types as ``dtype[dims]``
    (``s8[131072,16,128]``), read from the call's ``operand_layout_constraints``."""
    layouts = r"operand_layout_constraints=\{((?:[^{}]|\{[^{}]*\})*)\}"  # {s8[..]{2,1,0}, ...}
    calls = re.findall(rf'custom_call_target="{re.escape(target)}", ' + layouts, hlo)
    return [re.findall(r"\w+\[[\d,]*\]", c) for c in calls]


__all__ = ["Instruction", "parse_module", "memory_bytes", "shape_bytes", "loop_bodies", "branch_computations",
           "custom_call_operands", "ARRAY", "DTYPE_BYTES"]
