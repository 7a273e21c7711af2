"""Compile the attention kernels for sm_90 without a GPU (Triton's own ptxas), and summarize
what came out: ``python tests/sm90_compile.py [VARIANT ...]`` prints one JSON object per kernel
variant (``--fp8-configs``: the decode kernel over an fp8 cache at each tile config of the
``kernels.bench`` fp8 sweep instead).

The interpreter runs a kernel's Python, not its compilation: a GPU-only error (a non-constexpr
global read in a jit function, a conversion the backend lacks) or a lost optimization (loads
that are not pipelined) shows only here or on the GPU. Run in a process of its own, without
``TRITON_INTERPRET``: the kernels must be ``JITFunction`` objects. Each summary gives the shared
memory, the registers per thread and the stack frame (where ptxas spills: 0, none; what
``n_regs``/``n_spills`` give once loaded on a GPU, here from the bundled ``cuobjdump``), the
number of ``cp.async`` copies in the PTX, the loads of the main loop that stayed synchronous
(``tt.load`` in the TTGIR's ``scf.for`` body), and the main loop's instructions, one
iteration (one KV tile per program): PTX and SASS counts and the PTX conversions,
shared-memory loads and MMAs by opcode."""

from __future__ import annotations

import collections
import functools
import json
import os
import re
import subprocess
import sys
import tempfile

os.environ.pop("TRITON_INTERPRET", None)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from kernels import decode, prefill, rope  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
# runtime ints that a launch does not specialize as multiples of 16 (the rest are pointers and
# strides of contiguous pools, which it does)
UNALIGNED = {"window", "num_splits", "min_split", "stride_btb", "eps"}


def _compile(jit, pointers: dict, consts: dict, **options):
    sig, attrs = {}, {}
    for i, name in enumerate(jit.arg_names):
        if name in consts:
            sig[name] = "constexpr"
        elif name in pointers:
            sig[name] = pointers[name]
            attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            sig[name] = "fp32" if name in ("qk_scale", "cap_in", "cap_out", "eps") else "i32"
            if name not in UNALIGNED and sig[name] == "i32":
                attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(jit, sig, constexprs=consts, attrs=attrs)
    return triton.compile(src, target=TARGET, options=options)


def _caches(fp8: bool, dt: str) -> dict:
    kv = "*fp8e4nv" if fp8 else f"*{dt}"
    return {"K": kv, "V": kv, "KS": "*bf16" if fp8 else kv, "VS": "*bf16" if fp8 else kv}


def decode_kernel(fp8: bool, dt: str = "bf16", d: int = 128, tiles=None, **flags):
    """Stage 1 of decode; ``tiles`` None: the launcher's (``decode_config``; float32 queries
    over an fp8 cache take the 16-bit caches' tiles, as in ``decode_attention``)."""
    tiles = tiles or decode.decode_config(d, fp8=fp8 and dt != "fp32")
    ptrs = {"Q": f"*{dt}", **_caches(fp8, dt), "SeqLens": "*i32", "BlockTables": "*i32",
            "PartOut": "*fp32", "PartLse": "*fp32", "Out": f"*{dt}", "Lse": "*fp32",
            "Counters": "*i32"}  # fmt: skip
    consts = dict(GROUP=4, HEAD_DIM=d, PAGE=16, DIRECT=False, STORE_LSE=False, PDL_WAIT=True,
                  CHAIN=True, WINDOWED=False, SOFTCAP=False, FP8=fp8, BLOCK_G=16,
                  BLOCK_N=tiles[0], BLOCK_D=d, MERGE_H=4, MERGE_S=8,
                  DOT_PRECISION="ieee" if dt == "fp32" else "tf32", PTX=True)  # fmt: skip
    consts.update(flags)
    return _compile(decode._decode_split_kernel, ptrs, consts, num_warps=tiles[1],
                    num_stages=tiles[2])  # fmt: skip


def prefill_kernel(fp8: bool, dt: str = "bf16", d: int = 128, cfg=(128, 128, 8, 2), **flags):
    ptrs = {"Q": f"*{dt}", **_caches(fp8, dt), "CuSeqlensQ": "*i32", "SeqLens": "*i32",
            "BlockTables": "*i32", "Out": f"*{dt}", "Lse": "*fp32"}  # fmt: skip
    consts = dict(GROUP=4, HEAD_DIM=d, PAGE=16, STORE_LSE=True, WINDOWED=False, SOFTCAP=False,
                  FP8=fp8, BLOCK_M=cfg[0], BLOCK_N=cfg[1], BLOCK_D=d,
                  DOT_PRECISION="ieee" if dt == "fp32" else "tf32")  # fmt: skip
    consts.update(flags)
    return _compile(prefill._prefill_kernel, ptrs, consts, num_warps=cfg[2], num_stages=cfg[3])


def rope_kernel(fp8: bool, dt: str = "bf16", d: int = 128):
    cache = "*fp8e4nv" if fp8 else f"*{dt}"
    ptrs = {"QKV": f"*{dt}", "Pos": "*i64", "Cos": f"*{dt}", "Sin": f"*{dt}", "QNorm": f"*{dt}",
            "KNorm": f"*{dt}", "QOut": f"*{dt}", "KCache": cache, "VCache": cache,
            "KScale": "*bf16" if fp8 else cache, "VScale": "*bf16" if fp8 else cache,
            "Slots": "*i64"}  # fmt: skip
    consts = dict(HQ=32, HKV=8, D=d, HALF=d // 2, PAGE=16, HAS_QNORM=False, HAS_KNORM=False,
                  UNIT_OFFSET=False, QUANT=fp8, BLOCK_HQ=32, BLOCK_HKV=8, BLOCK_HALF=d // 2,
                  BLOCK_PASS=0, BLOCK_D=d, PDL=True, CHAIN=True)  # fmt: skip
    return _compile(rope._rope_write_kv_kernel, ptrs, consts, num_warps=4, enable_fp_fusion=False)


def _tool(name: str) -> str:
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def _longest_loop(text: str, label: str, branch: str) -> str:
    """The longest span from a label to a branch back to it (the KV loop of these kernels)."""
    best = ""
    for m in re.finditer(label, text, re.M):
        back = re.search(branch.format(re.escape(m.group(1))), text[m.end() :])
        if back and back.end() > len(best):
            best = text[m.end() : m.end() + back.end()]
    return best


def _ptx_loop(ptx: str) -> list[str]:
    """Opcodes of the main loop's PTX instructions (labels, braces and directives left out)."""
    body = _longest_loop(ptx, r"^(\$L__BB\d+_\d+):", r"bra(?:\.uni)?\s+{};")
    lines = (line.strip() for line in body.splitlines())
    return [re.sub(r"^@!?%p\d+\s+", "", line).split()[0].rstrip(";") for line in lines
            if line and not line.startswith(("//", "$", "{", "}", "."))]  # fmt: skip


def _cubin_facts(cubin: bytes) -> dict:
    """Registers, stack frame bytes (spills) and the main loop's SASS instruction count."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        usage = subprocess.run([_tool("cuobjdump"), "--dump-resource-usage", f.name],
                               capture_output=True, text=True, check=True).stdout  # fmt: skip
        sass = subprocess.run([_tool("cuobjdump"), "-sass", f.name], capture_output=True,
                              text=True, check=True).stdout  # fmt: skip
    code = [(int(a, 16), op) for a, op in re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    start = end = 0  # the longest backward branch
    for addr, op in code:
        m = re.search(r"BRA (0x[0-9a-f]+)", op)
        if m and int(m.group(1), 16) < addr and addr - int(m.group(1), 16) > end - start:
            start, end = int(m.group(1), 16), addr
    return {
        "regs": int(re.search(r"REG:(\d+)", usage)[1]),
        "stack": int(re.search(r"STACK:(\d+)", usage)[1]),
        "loop_sass": sum(start <= addr <= end for addr, _ in code),
    }


def summary(kernel) -> dict:
    ttgir, ptx = kernel.asm["ttgir"], kernel.asm["ptx"]
    loop = ttgir[ttgir.find("scf.for") :]
    loop = loop[: loop.find("scf.yield")] if "scf.for" in ttgir else ""
    ops = _ptx_loop(ptx)
    counts = collections.Counter(
        op for op in ops if op.startswith(("cvt", "ld.shared", "ldmatrix", "mma"))
    )
    return {
        "shared": kernel.metadata.shared,
        "cp_async": len(re.findall(r"cp\.async\.c[ag]", ptx)),
        "loop_loads": re.findall(r"tt\.load [^:]*: (tensor<[^>]*>)", loop),
        **_cubin_facts(kernel.asm["cubin"]),
        "loop_ptx": len(ops),
        "loop_ops": dict(sorted(counts.items())),
    }


VARIANTS = {
    "decode-bf16": lambda: decode_kernel(False),
    "decode-fp8": lambda: decode_kernel(True),
    "decode-fp8-fp16": lambda: decode_kernel(True, dt="fp16"),
    "decode-fp8-d256-window-softcap": lambda: decode_kernel(True, d=256, WINDOWED=True,
                                                           SOFTCAP=True),
    "decode-fp8-fp32": lambda: decode_kernel(True, dt="fp32"),
    "prefill-fp8": lambda: prefill_kernel(True),
    "prefill-fp8-d256-window-softcap": lambda: prefill_kernel(True, d=256, cfg=(128, 64, 8, 2),
                                                             WINDOWED=True, SOFTCAP=True),
    "rope-fp8": lambda: rope_kernel(True),
}  # fmt: skip


def fp8_configs() -> dict:
    """The decode kernel over an fp8 cache (bf16 queries, head dim 128) at each tile config
    that ``kernels.bench --kv-dtype fp8 --sweep decode-config`` times."""
    from kernels.bench import FP8_DECODE_CONFIGS

    return {f"decode-fp8-{'x'.join(map(str, c))}": functools.partial(decode_kernel, True, tiles=c)
            for c in FP8_DECODE_CONFIGS}  # fmt: skip


if __name__ == "__main__":
    names = sys.argv[1:]
    variants = fp8_configs() if names == ["--fp8-configs"] else VARIANTS
    for name in variants if names in ([], ["--fp8-configs"]) else names:
        print(json.dumps({"variant": name, **summary(variants[name]())}), flush=True)
