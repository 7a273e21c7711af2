"""Compile the attention kernels for sm_90 without a GPU (Triton's own ptxas), and summarize
what came out: ``python tests/sm90_compile.py`` prints one JSON object per kernel variant.

The interpreter runs a kernel's Python, not its compilation: a GPU-only error (a non-constexpr
global read in a jit function, a conversion the backend lacks) or a lost optimization (loads
that are not pipelined) shows only here or on the GPU. Run in a process of its own, without
``TRITON_INTERPRET``: the kernels must be ``JITFunction`` objects. Each summary gives the shared
memory, registers and stack (spills), the number of ``cp.async`` copies, bulk tensor copies
(TMA) and warpgroup MMAs (``wgmma``) in the PTX, and the loads of the innermost loops that
stayed synchronous (``tt.load`` of a tensor in the TTGIR's innermost ``scf.for`` bodies)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile

os.environ.pop("TRITON_INTERPRET", None)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from kernels import decode, prefill, rope  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
# runtime ints that a launch does not specialize as multiples of 16 (the rest are pointers and
# strides of contiguous pools, which it does)
UNALIGNED = {"window", "num_splits", "min_split", "stride_btb", "eps", "n_tiles", "n_heads",
             "n_seqs"}  # fmt: skip


def _compile(jit, pointers: dict, consts: dict, **options):
    sig, attrs = {}, {}
    for i, name in enumerate(jit.arg_names):
        if name in consts:
            sig[name] = "constexpr"
        elif name in pointers:  # pointers (16-byte aligned) or tensor descriptors
            sig[name] = pointers[name]
            if sig[name].startswith("*"):
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


def decode_kernel(fp8: bool, dt: str = "bf16", d: int = 128, tiles=(64, 4, 4), **flags):
    ptrs = {"Q": f"*{dt}", **_caches(fp8, dt), "SeqLens": "*i32", "BlockTables": "*i32",
            "PartOut": "*fp32", "PartLse": "*fp32", "Out": f"*{dt}", "Lse": "*fp32",
            "Counters": "*i32"}  # fmt: skip
    consts = dict(GROUP=4, HEAD_DIM=d, PAGE=16, DIRECT=False, STORE_LSE=False, PDL_WAIT=True,
                  CHAIN=True, WINDOWED=False, SOFTCAP=False, FP8=fp8, BLOCK_G=16,
                  BLOCK_N=tiles[0], BLOCK_D=d, MERGE_H=4, MERGE_S=8,
                  DOT_PRECISION="ieee" if dt == "fp32" else "tf32")  # fmt: skip
    consts.update(flags)
    return _compile(decode._decode_split_kernel, ptrs, consts, num_warps=tiles[1],
                    num_stages=tiles[2])  # fmt: skip


def prefill_kernel(fp8: bool, dt: str = "bf16", d: int = 128, cfg=(128, 128, 8, 2), _types=None,
                   **flags):  # fmt: skip
    ptrs = {"Q": f"*{dt}", **_caches(fp8, dt), "CuSeqlensQ": "*i32", "SeqLens": "*i32",
            "BlockTables": "*i32", "Out": f"*{dt}", "Lse": "*fp32", **(_types or {})}  # fmt: skip
    consts = dict(GROUP=4, HEAD_DIM=d, PAGE=16, STORE_LSE=True, WINDOWED=False, SOFTCAP=False,
                  FP8=fp8, TMA=False, PERSISTENT=False, BLOCK_M=cfg[0], BLOCK_N=cfg[1], BLOCK_D=d,
                  DOT_PRECISION="ieee" if dt == "fp32" else "tf32")  # fmt: skip
    consts.update(flags)
    return _compile(prefill._prefill_kernel, ptrs, consts, num_warps=cfg[2], num_stages=cfg[3])


def hopper_prefill_kernel(d: int = 128, page: int = 128, cfg=None, dt="bf16"):
    """The Hopper path (``prefill_attention(path="hopper")``): K/V as tensor descriptors of
    ``[BLOCK_N, D]`` blocks, the persistent loop; ``cfg`` by default ``hopper_config``'s."""
    cfg = cfg or prefill.hopper_config(d, torch.bfloat16, page)[:4]
    desc = f"tensordesc<{dt}[{cfg[1]}, {d}]>"
    return prefill_kernel(False, dt, d, cfg, PAGE=page, TMA=True, PERSISTENT=True,
                          _types={"K": desc, "V": desc})  # fmt: skip


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


def resources(kernel) -> dict:
    """Registers per thread and the stack frame (where spills go) of the cubin, read by the
    ``cuobjdump`` that ships with Triton (``CompiledKernel.n_regs`` / ``n_spills`` are only
    filled in when the kernel is loaded on a GPU)."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        out = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True,
                             text=True, check=True).stdout  # fmt: skip
    regs, stack, local = re.search(r"REG:(\d+) STACK:(\d+) SHARED:\d+ LOCAL:(\d+)", out).groups()
    return {"regs": int(regs), "stack_bytes": int(stack), "local_bytes": int(local)}


def summary(kernel) -> dict:
    ttgir, ptx = kernel.asm["ttgir"], kernel.asm["ptx"]
    # the innermost loops (the KV loops, not the Hopper path's persistent loop around them)
    loop = ""
    for m in re.finditer("scf.for", ttgir):
        body = ttgir[m.end() : ttgir.find("scf.yield", m.end())]
        loop += "" if "scf.for" in body else body
    return {
        "shared": kernel.metadata.shared,
        **resources(kernel),
        "cp_async": len(re.findall(r"cp\.async\.c[ag]", ptx)),
        "tma_loads": len(re.findall(r"cp\.async\.bulk\.tensor", ptx)),
        "wgmma": len(re.findall(r"wgmma\.mma_async", ptx)),
        "mma_sync": len(re.findall(r"\bmma\.sync", ptx)),
        "loop_loads": re.findall(r"tt\.load [^:]*: (tensor<[^>]*>)", loop),
        # tiles in flight per multi-buffered shared allocation (the pipeline's depth)
        "buffers": sorted(
            {
                int(n)
                for n in re.findall(r"local_alloc : \(\) -> !ttg\.memdesc<(\d+)x\d+x\d+x", ttgir)
            }
        ),
    }


VARIANTS = {
    "decode-bf16": lambda: decode_kernel(False),
    "decode-fp8": lambda: decode_kernel(True),
    "decode-fp8-d256-window-softcap": lambda: decode_kernel(True, d=256, tiles=(64, 4, 3),
                                                           WINDOWED=True, SOFTCAP=True),
    "decode-fp8-fp32": lambda: decode_kernel(True, dt="fp32"),
    "prefill-bf16": lambda: prefill_kernel(False),
    "prefill-bf16-d64": lambda: prefill_kernel(False, d=64, cfg=(128, 64, 8, 3)),
    "prefill-bf16-d256": lambda: prefill_kernel(False, d=256, cfg=(128, 64, 8, 2)),
    "prefill-bf16-page128": lambda: prefill_kernel(False, PAGE=128),
    "prefill-fp8": lambda: prefill_kernel(True),
    "prefill-fp8-d256-window-softcap": lambda: prefill_kernel(True, d=256, cfg=(128, 64, 8, 2),
                                                             WINDOWED=True, SOFTCAP=True),
    "prefill-hopper-d128-page128": lambda: hopper_prefill_kernel(),
    "prefill-hopper-d128-page128-2stages": lambda: hopper_prefill_kernel(cfg=(128, 128, 8, 2)),
    "prefill-hopper-d128-page64": lambda: hopper_prefill_kernel(page=64),
    "prefill-hopper-d64": lambda: hopper_prefill_kernel(64, 64),
    "prefill-hopper-d256": lambda: hopper_prefill_kernel(256, 64),
    "rope-fp8": lambda: rope_kernel(True),
}  # fmt: skip


if __name__ == "__main__":
    for name in sys.argv[1:] or VARIANTS:
        print(json.dumps({"variant": name, **summary(VARIANTS[name]())}), flush=True)
