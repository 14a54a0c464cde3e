"""What the fused attention kernels cost per tile on an H100/H200, read off the machine code, no GPU needed.

    python -m bench.triton_census [--every-candidate] [--no-dropout] [--json FILE]

Compiles the three kernels of attn_impl "triton" (txl_dist/model/triton_attention.py) for sm_90 as Triton's
launcher would at configs/large.json's attention (bf16, d_head 64, pointers and lengths specialized as at run
time), disassembles them with the nvdisasm that ships with triton, and counts the SASS instructions of each
loop over tiles: per thread and per tile, by kind (HGMMA, MUFU, FSEL, ISETP, ...). Also registers per thread
and spill stores (cuobjdump --dump-resource-usage, STL).

Why this number: a tile of 64 x 64 scores at d_head 64 is 2 x 262,144 multiply-adds (QK^T and PV in the
forward), 256 cycles of an SM's tensor cores at the bf16 data-sheet rate (989 TFLOP/s over 132 SMs at 1.83 GHz
is 2048 per cycle). Everything else a thread does per tile is issued by the SM's four schedulers, one warp
instruction per cycle each: `issue_cycles = warps x instructions / 4` is a lower bound on the tile's time
whenever it exceeds the tensor cores' (FlashAttention-3's observation at d_head 64: the softmax's and the
mask's instructions, not the products, bound the kernel). The ratio issue / tensor is printed per loop; it
predicts which code changes speed the kernel up before a GPU times it. Not a timing: latencies, memory stalls
and two CTAs sharing an SM are not modelled.

Each kernel's floor at large's attention (`--heads-batch` rows, default micro batch 8 x 16 heads) sums its
loops' issue cycles over the tiles it runs, counted by the kernels' own range arithmetic in Triton's
interpreter (`loop_trips`), on a whole H100/H200: the figure a GPU's measured kernel time (gpu_check's
attention_profile) is compared with.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile

import torch
import triton
import triton.language as tl

from txl_dist.model import triton_kernels

TENSOR_MACS_PER_CYCLE = 2048
"""bf16 dense multiply-adds per SM and cycle on an H100/H200: 989.4e12 / 2 / 132 SMs / 1.83e9 Hz."""

SM_COUNT = 132
SM_CLOCK_HZ = 989.4e12 / 2 / TENSOR_MACS_PER_CYCLE / SM_COUNT
"""An H100/H200's SMs and the clock its bf16 data-sheet rate implies (~1.83 GHz): the floors' time base."""

PRODUCTS_PER_TILE = {"fwd": 2, "dkdv": 4, "dq": 3}
"""Tile-sized matrix products per kernel: QK^T and PV; the backward's recomputed QK^T and dO V^T, then dV and dK
(dkdv) or dQ (dq)."""

_INSTRUCTION = re.compile(r"\s*/\*([0-9a-f]+)\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);")
_LABEL = re.compile(r"^(\.L_x_\d+):")


def _tool(name: str) -> str:
    import triton

    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)
    if not os.path.exists(path):
        raise SystemExit(f"triton_census: {path} is missing (this triton ships no {name})")
    return path


def _run_tool(name: str, cubin: bytes, *args: str) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([_tool(name), *args, f.name], capture_output=True, text=True, check=True).stdout


def instructions(sass: str) -> list[tuple[int, str, str]]:
    """(address, opcode, operands) of each instruction; labels map to the address of the next one."""
    found, labels, pending = [], {}, []
    for line in sass.splitlines():
        label = _LABEL.match(line)
        if label:
            pending.append(label.group(1))
            continue
        m = _INSTRUCTION.match(line)
        if m:
            address = int(m.group(1), 16)
            found.append((address, m.group(2), m.group(3)))
            labels.update((name, address) for name in pending)
            pending = []
    return _with_targets(found, labels)


def _with_targets(found, labels):
    """Resolves branch targets written as labels into addresses (the operand becomes the hex address)."""
    out = []
    for address, op, rest in found:
        target = re.search(r"(\.L_x_\d+)", rest)
        if op.startswith("BRA") and target and target.group(1) in labels:
            rest = hex(labels[target.group(1)])
        out.append((address, op, rest))
    return out


def loops(found: list[tuple[int, str, str]]) -> list[tuple[list[str], list[str]]]:
    """The opcodes and operands of each loop body, in the code's order: from a backward branch's target to the
    branch."""
    bodies = []
    for address, op, rest in found:
        if op.startswith("BRA") and rest.startswith("0x") and int(rest, 16) < address:
            start = int(rest, 16)
            body = [(o, r) for a, o, r in found if start <= a <= address]
            bodies.append(([o for o, _ in body], [r for _, r in body]))
    return bodies


@triton.jit
def _loop_trips(OUT, T, KL, MLEN, WINDOW, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BY_KEYS: tl.constexpr):
    """Per program: the trips of a kernel's three loops (whole tiles, the low edge, the high edge), by the
    kernels' own range arithmetic."""
    pid = tl.program_id(0)
    if BY_KEYS:  # dkdv: a key block over query blocks
        start = pid * BLOCK_N
        lo, hi = triton_kernels._query_range(start, BLOCK_M, BLOCK_N, T, MLEN, WINDOW)
        a, b = triton_kernels._full_queries(start, lo, hi, T, KL, MLEN, WINDOW, BLOCK_M, BLOCK_N)
        step: tl.constexpr = BLOCK_M
    else:
        start = pid * BLOCK_M
        lo, hi = triton_kernels._key_range(start, BLOCK_M, BLOCK_N, KL, MLEN, WINDOW)
        a, b = triton_kernels._full_keys(start, lo, hi, T, KL, MLEN, WINDOW, BLOCK_M, BLOCK_N)
        step: tl.constexpr = BLOCK_N
    tl.store(OUT + pid * 3, (tl.maximum(b - a, 0) + step - 1) // step)
    tl.store(OUT + pid * 3 + 1, (tl.maximum(a - lo, 0) + step - 1) // step)
    tl.store(OUT + pid * 3 + 2, (tl.maximum(hi - b, 0) + step - 1) // step)


def trips_interpreted(name: str, block_m: int, block_n: int, qlen: int, klen: int, window: int) -> list[int]:
    """The trips of kernel `name`'s three loops summed over one head-batch row's programs (Triton's interpreter:
    run it with TRITON_INTERPRET=1)."""
    by_keys = name == "dkdv"
    programs = -(-(klen if by_keys else qlen) // (block_n if by_keys else block_m))
    out = torch.zeros(programs * 3, dtype=torch.int32)
    _loop_trips[(programs,)](out, qlen, klen, klen - qlen, window, BLOCK_M=block_m, BLOCK_N=block_n, BY_KEYS=by_keys)
    return out.view(programs, 3).sum(0).tolist()


def loop_trips(cases: list[tuple[str, int, int]], shape) -> list[list[int]]:
    """trips_interpreted of each (kernel, block_m, block_n) at `shape` (a TargetShape), in a process of its own
    (this one compiles for the GPU, so its kernels are not interpreted)."""
    calls = ", ".join(f"trips_interpreted({name!r}, {m}, {n}, {shape.qlen}, {shape.klen}, {shape.window})"
                      for name, m, n in cases)
    code = f"from bench.triton_census import trips_interpreted; print([{calls}])"
    done = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, TRITON_INTERPRET="1"),
                          capture_output=True, text=True, check=True,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return json.loads(done.stdout.strip().splitlines()[-1])


def floors(row: dict, trips: list[int], heads_batch: int) -> dict:
    """A kernel's issue floor and tensor-core time at `heads_batch` head-batch rows of the census shape, in
    microseconds on a whole H100/H200: every loop's trips times its issue (tensor) cycles per tile, over
    SM_COUNT SMs at SM_CLOCK_HZ. Edge tiles count at their loops' cost; stalls, tails and the code outside the
    loops are not modelled."""
    scale = heads_batch / SM_COUNT / SM_CLOCK_HZ * 1e6
    issue = sum(n * loop["issue_cycles"] for n, loop in zip(trips, row["loops"]))
    tensor = sum(n * loop["tensor_cycles"] for n, loop in zip(trips, row["loops"]))
    return dict(trips=trips, heads_batch=heads_batch, floor_us=round(issue * scale, 1),
                tensor_us=round(tensor * scale, 1))


def census(name: str, blocks, compiled, d_head: int) -> dict:
    cubin = compiled.asm["cubin"]
    found = instructions(_run_tool("nvdisasm", cubin, "-c"))
    usage = _run_tool("cuobjdump", cubin, "--dump-resource-usage")
    registers = re.search(r"REG:(\d+)", usage)
    tile_macs = PRODUCTS_PER_TILE[name] * blocks.block_m * blocks.block_n * d_head
    tensor_cycles = tile_macs / TENSOR_MACS_PER_CYCLE
    per_loop = []
    for body, operands in loops(found):
        kinds = collections.Counter(op.split(".")[0] for op in body)
        issue_cycles = blocks.num_warps * len(body) / 4
        per_loop.append(dict(instructions=len(body), per_score=round(len(body) * blocks.num_warps * 32
                                                                    / (blocks.block_m * blocks.block_n), 1),
                             issue_cycles=issue_cycles, tensor_cycles=tensor_cycles,
                             issue_over_tensor=round(issue_cycles / tensor_cycles, 2),
                             mask_selects=sum(1 for op, rest in zip(body, operands)
                                              if op.startswith("FSEL") and "-INF" in rest),
                             local_memory=sum(1 for op in body if op.startswith(("LDL", "STL"))),
                             kinds=dict(kinds.most_common(12))))
    return dict(kernel=name, tiles=f"{blocks.block_m}x{blocks.block_n}/{blocks.num_warps}w/{blocks.num_stages}s",
                registers=int(registers.group(1)) if registers else None,
                spill_stores=sum(1 for _, op, _ in found if op.startswith("STL")),
                instructions=len(found), loops=per_loop)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--every-candidate", action="store_true", help="every tile the tuner may pick")
    parser.add_argument("--no-dropout", action="store_true", help="kernels compiled without attention dropout")
    parser.add_argument("--d-head", type=int, default=64)
    parser.add_argument("--json", help="also write the census as JSON lines here")
    parser.add_argument("--heads-batch", type=int, default=128,
                        help="head-batch rows the floors count (default: large's attention at micro batch 8, 8 x 16)")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("triton_census: unset TRITON_INTERPRET (the interpreter compiles nothing)")
    from txl_dist.model import triton_attention

    kernels = [(name, blocks, compiled) for name, blocks, compiled in
               triton_attention.compile_for_target(90, torch.bfloat16, args.d_head, dropout=not args.no_dropout,
                                                   every_candidate=args.every_candidate)
               if name in PRODUCTS_PER_TILE]  # not the zero-store kernel: it has no tiles of scores
    rows = [census(name, blocks, compiled, args.d_head) for name, blocks, compiled in kernels]
    shape = triton_attention.TargetShape()
    cases = [(name, blocks.block_m, blocks.block_n) for name, blocks, _ in kernels]
    for row, trips in zip(rows, loop_trips(cases, shape)):
        row.update(floors(row, trips, args.heads_batch))
    print(f"sm_90, bf16, d_head {args.d_head}, dropout {'off' if args.no_dropout else 'on'}; per thread and tile; "
          f"floors at {args.heads_batch} head-batch rows of T {shape.qlen}, KL {shape.klen} on {SM_COUNT} SMs")
    for row in rows:
        print(f"{row['kernel']:5} {row['tiles']:15} {row['registers']} registers, {row['spill_stores']} spill "
              f"stores, {row['instructions']} instructions; loop trips {row['trips']} per head-batch row: issue "
              f"floor {row['floor_us']} us, tensor cores {row['tensor_us']} us")
        for i, loop in enumerate(row["loops"]):
            kinds = ", ".join(f"{k} {v}" for k, v in loop["kinds"].items())
            print(f"      loop {i}: {loop['instructions']} instructions ({loop['per_score']} per score, "
                  f"{loop['mask_selects']} -inf selects, {loop['local_memory']} spill accesses), issue "
                  f"{loop['issue_cycles']:.0f} / tensor {loop['tensor_cycles']:.0f} cycles = "
                  f"{loop['issue_over_tensor']}x | {kinds}")
    if args.json:
        with open(args.json, "a") as f:
            for row in rows:
                f.write(json.dumps(dict(row, dropout=not args.no_dropout, d_head=args.d_head)) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
