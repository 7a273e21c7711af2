"""Compile the attention and GEMV kernels for sm_90 without a GPU (Triton's own ptxas), and
summarize what came out: ``python tests/sm90_compile.py [PREFIX ...]`` prints one JSON object
per kernel variant (those whose names start with a PREFIX: ``decode``, ``gemv-fp8``, ...;
``--fp8-configs``: the decode kernel over an fp8 cache at each tile config of the
``kernels.bench`` fp8 sweep instead).

The interpreter runs a kernel's Python, not its compilation: a GPU-only error (a non-constexpr
global read in a jit function, a conversion the backend lacks) or a lost optimization (loads
that are not pipelined) shows only here or on the GPU. Run in a process of its own, without
``TRITON_INTERPRET``: the kernels must be ``JITFunction`` objects. Every summary gives the
shared memory, the registers per thread and the stack frame (where ptxas spills; what
``n_regs``/``n_spills`` give once loaded on a GPU, here from the bundled ``cuobjdump``) and the
main loop (the longest loop: the KV loop of the attention kernels, the K loop of the GEMV), one
iteration: its PTX and SASS instruction counts, its PTX instructions by kind (``cvt``, ``fma``,
``mma``, ``wgmma``, global loads and ``cp.async``, shared loads) and the conversions,
shared-memory loads and MMAs by opcode; a GEMV's also per byte of weight a thread streams. The
attention kernels' also give the number of ``cp.async`` copies, bulk tensor copies (TMA) and
warpgroup MMAs in the PTX, the loads of the pipelined innermost loops that stayed synchronous
(``tt.load`` of a tensor in those TTGIR ``scf.for`` bodies) and the pipelines' depth."""

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

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.experimental.gluon._runtime import GluonASTSource  # noqa: E402

from kernels import decode, gemv, norm, prefill, prefill_gluon, rope  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
# runtime ints that a launch does not specialize as multiples of 16 (the rest are pointers and
# strides of contiguous pools, which it does)
UNALIGNED = {"window", "num_splits", "min_split", "stride_btb", "eps", "n_tiles", "n_heads",
             "n_seqs"}  # fmt: skip


def _compile(jit, pointers: dict, consts: dict, **options):
    """``jit`` (a Triton or Gluon kernel) for sm_90: ``pointers`` maps argument names to their
    types (``*bf16``, ``tensordesc<...>``), ``consts`` the constexprs; other arguments are
    i32 (fp32 for the scales)."""
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
    source = GluonASTSource if jit.is_gluon() else ASTSource
    src = source(jit, sig, constexprs=consts, attrs=attrs)
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
                  DOT_PRECISION="ieee" if dt == "fp32" else "tf32", PTX=True,
                  SCALES_AHEAD=decode.scales_ahead(fp8, *tiles[:2]),
                  # the prefetch before the wait compiled in, as fp8 and wide caches take it
                  PREFETCH=decode.DEFAULT_DECODE_TUNING.fp8_prefetch_tokens)  # fmt: skip
    consts.update(flags)
    return _compile(decode._decode_split_kernel, ptrs, consts, num_warps=tiles[1],
                    num_stages=tiles[2])  # fmt: skip


def prefill_kernel(fp8: bool, dt: str = "bf16", d: int = 128, cfg=(128, 128, 8, 2), _types=None,
                   **flags):  # fmt: skip
    ptrs = {"Q": f"*{dt}", **_caches(fp8, dt), "CuSeqlensQ": "*i32", "SeqLens": "*i32",
            "BlockTables": "*i32", "Out": f"*{dt}", "Lse": "*fp32", **(_types or {})}  # fmt: skip
    consts = dict(GROUP=4, HEAD_DIM=d, PAGE=16, STORE_LSE=True, WINDOWED=False, SOFTCAP=False,
                  FP8=fp8, TMA=False, HEAD_MAJOR=False, PERSISTENT=False, SPLIT=False,
                  BLOCK_M=cfg[0], BLOCK_N=cfg[1], BLOCK_D=d,
                  DOT_PRECISION="ieee" if dt == "fp32" else "tf32")  # fmt: skip
    consts.update(flags)
    return _compile(prefill._prefill_kernel, ptrs, consts, num_warps=cfg[2], num_stages=cfg[3])


def hopper_prefill_kernel(d: int = 128, page: int = 128, cfg=None, dt="bf16", fp8=False,
                          **flags):  # fmt: skip
    """The Hopper path (``prefill_attention(path="hopper")``): K/V as tensor descriptors of
    ``[BLOCK_N, D]`` blocks (e4m3 ones over an fp8 cache, its scale pools as pointers), the
    persistent loop; ``cfg`` by default ``hopper_config``'s."""
    cfg = cfg or prefill.hopper_config(d, torch.bfloat16, page)[:4]
    desc = f"tensordesc<{'fp8e4nv' if fp8 else dt}[{cfg[1]}, {d}]>"
    types = {"K": desc, "V": desc}
    if fp8 and cfg[1] >= prefill.SCALE_TMA_MIN_N:  # the scale pools as one run each
        types.update(KS=f"tensordesc<bf16[{cfg[1]}]>", VS=f"tensordesc<bf16[{cfg[1]}]>")
    flags = {"PAGE": page, "TMA": True, "PERSISTENT": True, **flags}
    return prefill_kernel(fp8, dt, d, cfg, _types=types, **flags)


def gluon_prefill_kernel(d: int = 128, page: int = 128, cfg=None, dt: str = "bf16"):
    """The Gluon kernel (``path="gluon"``) as ``gluon_prefill`` launches it; ``cfg`` a
    ``GluonConfig``, by default ``gluon_config``'s."""
    pg = prefill_gluon
    cfg = cfg or pg.gluon_config(d, torch.bfloat16, page)
    layout = pg.gl.NVMMASharedLayout.get_default_for([cfg.block_n, d], pg._GL_DTYPES[
        {"bf16": torch.bfloat16, "fp16": torch.float16}[dt]])  # fmt: skip
    desc = f"tensordesc<{dt}[{cfg.block_n}, {d}],{layout!r}>"
    ptrs = {"Q": f"*{dt}", "k_desc": desc, "v_desc": desc, "CuSeqlensQ": "*i32",
            "SeqLens": "*i32", "BlockTables": "*i32", "Out": f"*{dt}", "Lse": "*fp32"}  # fmt: skip
    consts = dict(GROUP=4, PAGE=page, STORE_LSE=True, STAGES=cfg.stages, PINGPONG=cfg.pingpong,
                  CONSUMER_REGS=cfg.consumer_regs, PRODUCER_REGS=cfg.producer_regs)  # fmt: skip
    return _compile(pg._gluon_prefill_kernel, ptrs, consts, num_warps=4, maxnreg=pg.MAXNREG)


class _CompileOnly:
    """A stand-in for Triton's CUDA driver: enough of it for a kernel's ``run(warmup=True)``
    to bind, specialize and compile its arguments for sm_90 without a GPU (and never launch)."""

    def get_current_device(self):
        return 0

    def get_current_stream(self, device):
        return 0

    def get_current_target(self):
        return TARGET


def gluon_launch_kernel(d: int = 128, page: int = 128):
    """The Gluon kernel as ``prefill_attention(path="gluon")`` launches it (``launch_args``:
    the launcher's own arguments, descriptors, strides and options through Triton's binder),
    on CPU tensors: GQA 8/2, two sequences, the LSE."""
    from triton.runtime.driver import driver

    driver.set_active(_CompileOnly())  # this process compiles only
    pg, dt = prefill_gluon, torch.bfloat16
    q = torch.zeros(300, 8, d, dtype=dt)
    pool = torch.zeros(8, page, 2, d, dtype=dt)
    cu, lens = torch.tensor([0, 100, 300], dtype=torch.int32), torch.tensor([150, 400])
    args = (q, pool, pool, cu, lens.int(), torch.zeros(2, 8, dtype=torch.int32), d**-0.5, 200,
            torch.empty_like(q), torch.empty(300, 8), pg.gluon_config(d, dt, page))  # fmt: skip
    grid, args, options = pg.launch_args(*args)
    return pg._gluon_prefill_kernel.run(*args, grid=grid, warmup=True, **options)


def rope_kernel(fp8: bool, dt: str = "bf16", d: int = 128, heads: tuple[int, int] = (32, 8)):
    """``heads``: the query and KV heads a program (``QH``, ``KH``)."""
    cache = "*fp8e4nv" if fp8 else f"*{dt}"
    ptrs = {"QKV": f"*{dt}", "Pos": "*i64", "Cos": f"*{dt}", "Sin": f"*{dt}", "QNorm": f"*{dt}",
            "KNorm": f"*{dt}", "QOut": f"*{dt}", "KCache": cache, "VCache": cache,
            "KScale": "*bf16" if fp8 else cache, "VScale": "*bf16" if fp8 else cache,
            "Slots": "*i64"}  # fmt: skip
    consts = dict(HQ=32, HKV=8, D=d, HALF=d // 2, PAGE=16, HAS_QNORM=False, HAS_KNORM=False,
                  UNIT_OFFSET=False, QUANT=fp8, QH=heads[0], KH=heads[1], BLOCK_HALF=d // 2,
                  BLOCK_PASS=0, BLOCK_D=d, PDL=True, CHAIN=True)  # fmt: skip
    warps = 4 if max(heads) * d >= 2048 else 2 if max(heads) * d >= 256 else 1
    return _compile(
        rope._rope_write_kv_kernel, ptrs, consts, num_warps=warps, enable_fp_fusion=False
    )


def gemv_kernel(
    w: str,
    x: str = "bf16",
    m: int = 1,
    tile=(8, 2048, 8, 3),
    w_scale: int = 0,
    x_rows: int | None = None,
    gated: int = 0,
    fold: bool = False,
    split: bool = False,
    diag: bool = False,
    norm: bool = False,
    residual: bool = False,
):
    """``_linear_kernel`` for an [m, K] x [N, K]^T product, unsplit (``split``: K split),
    K a multiple of BLOCK_K; ``w``: the weight's Triton type (``fp8e4nv`` with ``w_scale`` 1
    or 2), ``tile``: (BLOCK_N, BLOCK_K, num_warps, num_stages); ``gated``: the gated MLP's
    epilogue (1 SiLU, 2 GELU-tanh, libdevice's tanh); ``fold``: the output sent to the peer
    rank too (``kernels.fold``); ``diag``: M = 1's x in chunks (``linear_small_m(diag=...)``);
    ``norm``: x RMSNormed as it loads (``norm=``); ``residual``: out added to the stream, its
    sums of squares stored (``residual=``). Compiled as ``linear_small_m`` launches it: M = 1
    and an unsplit grid's one split constants (Triton specializes an int argument of 1),
    ptxas's register cap from ``kernels.gemv.max_regs_for``."""
    ptrs = {"X": f"*{x}", "W": f"*{w}", "Bias": f"*{x}", "Scale": "*fp32", "Out": f"*{x}",
            "Part": "*fp32", "Counters": "*i32"}  # fmt: skip
    if fold:
        ptrs.update(Send="*i64", Calls="*i64")
    unfolded = {} if fold else dict(Send=None, Calls=None, stride_send=0)
    if norm:
        ptrs.update(NormSq="*fp32", NormW=f"*{x}")
        unfolded.update(NORM_PARTS=256, NORM_X=True, norm_eps=0.0)
    else:
        unfolded.update(NormSq=None, NormW=None, norm_parts=0, norm_eps=0.0, NORM_PARTS=1,
                        NORM_X=False)  # fmt: skip
    if residual:
        ptrs.update(Res=f"*{x}", SumSq="*fp32")
        unfolded.update(ADD_RES=True)
    else:
        unfolded.update(Res=None, SumSq=None, stride_rm=0, ADD_RES=False)
    fp8 = w_scale > 0
    dot = m > 1 or fp8 or diag
    consts = dict(HAS_BIAS=False, SPLIT=split, USE_DOT=dot, EVEN_K=True,
                  BLOCK_M=16 if dot and not diag else 1, BLOCK_N=tile[0], BLOCK_K=tile[1],
                  NUM_STAGES=tile[3], MERGE_S=4 if split else 1, CHAIN=True, W_SCALE=w_scale,
                  DOT_PRECISION="ieee" if x == "fp32" else "tf32",
                  X_ROWS=x_rows or (triton.next_power_of_2(m) if fp8 else 16 if dot else 1),
                  F16_DOT=fp8 and x != "fp32", DIAG=diag, GATED=gated, LIBDEVICE=True,
                  FOLD=fold,
                  **unfolded)  # fmt: skip
    if m == 1:
        consts["M"] = 1
    if not split:
        consts["num_splits"] = 1
    return _compile(gemv._linear_kernel, ptrs, consts, num_warps=tile[2], num_stages=tile[3],
                    maxnreg=gemv.max_regs_for(tile[2], w_scale, residual) or None)  # fmt: skip


def norm_kernel(dt: str = "bf16", h: int = 4096, fold: bool = False, post: bool = False):
    """``_rms_norm_kernel`` with the residual add as ``add_rms_norm`` launches it (``post``:
    Gemma's ``norm_add_norm``, ``1 + w``); ``fold``: waiting for the peer rank's partial sums
    and adding them first (``kernels.fold``)."""
    ptrs = {"X": f"*{dt}", "Res": f"*{dt}", "WPost": f"*{dt}", "W": f"*{dt}", "Out": f"*{dt}",
            "ResOut": f"*{dt}"}  # fmt: skip
    unfolded = dict(Recv=None, Calls=None, Status=None, stride_recv=0, spin_limit=0)
    if fold:
        ptrs.update(Recv="*i64", Calls="*i64", Status="*i64", spin_limit="i64")
        unfolded = {}
    block = triton.next_power_of_2(h)
    consts = dict(H=h, HAS_RES=True, POST_NORM=post, POST_F32=False, UNIT_OFFSET=post,
                  BLOCK=block, CHAIN=True, FOLD=fold, **unfolded)  # fmt: skip
    return _compile(norm._rms_norm_kernel, ptrs, consts, num_warps=max(1, min(16, block // 512)))


def _tool(name: str) -> str:
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def _on_cubin(kernel, tool: str, *args: str) -> str:
    """The output of one of Triton's bundled CUDA tools run on the kernel's cubin."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        return subprocess.run([_tool(tool), *args, f.name], capture_output=True, text=True,
                              check=True).stdout  # fmt: skip


def resources(kernel) -> dict:
    """Registers per thread and the stack frame (where spills go) of the cubin."""
    out = _on_cubin(kernel, "cuobjdump", "--dump-resource-usage")
    regs, stack, local = re.search(r"REG:(\d+) STACK:(\d+) SHARED:\d+ LOCAL:(\d+)", out).groups()
    return {"regs": int(regs), "stack_bytes": int(stack), "local_bytes": int(local)}


def _longest_loop(text: str, label: str, branch: str) -> str:
    """The longest span from a label to a branch back to it (the main loop of these kernels)."""
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


def _sass_code(kernel) -> list[tuple[int, str]]:
    """The cubin's SASS as (address, instruction)."""
    sass = _on_cubin(kernel, "cuobjdump", "-sass")
    return [(int(a, 16), op) for a, op in re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]


def _backward_branches(code) -> list[tuple[int, int]]:
    """(target, branch) of every backward branch: the loops."""
    spans = []
    for addr, op in code:
        m = re.search(r"BRA (0x[0-9a-f]+)", op)
        if m and int(m.group(1), 16) < addr:
            spans.append((int(m.group(1), 16), addr))
    return spans


def _count(code, span) -> tuple[int, int]:
    """SASS instructions in ``span``, and how many are local-memory loads and stores."""
    body = [op for addr, op in code if span[0] <= addr <= span[1]]
    return len(body), sum(bool(re.match(r"(@!?P\d+\s+)?(LDL|STL)\b", op)) for op in body)


def _sass_loop(kernel) -> tuple[int, int]:
    """SASS instructions of the main loop (those within the longest backward branch), and how
    many of them are local-memory loads and stores (spills in the loop)."""
    code = _sass_code(kernel)
    return _count(code, max(_backward_branches(code), key=lambda s: s[1] - s[0], default=(0, 0)))


def inner_loops(kernel) -> list[list[int]]:
    """[SASS instructions, local loads and stores] of each innermost loop (a backward branch
    around no other; barrier-wait retries of a few instructions left out), in address order:
    the KV loops of the attention kernels (the unmasked tiles', the diagonal's), apart from a
    persistent loop around them."""
    code = _sass_code(kernel)
    spans = [s for s in _backward_branches(code) if _count(code, s)[0] > 8]
    inner = [a for a in spans if not any(b != a and a[0] <= b[0] and b[1] <= a[1] for b in spans)]
    return [list(_count(code, span)) for span in sorted(inner)]


_PTX_KINDS = {
    "cvt": ("cvt.",),
    "fma": ("fma.",),
    "mma": ("mma.",),
    "wgmma": ("wgmma.mma",),
    "ld_global": ("ld.global", "cp.async.c"),
    "ld_shared": ("ld.shared", "ldmatrix"),
}


def loop_mix(kernel, weight_bytes: int | None = None) -> dict:
    """The main loop, one iteration per thread: PTX and SASS instruction counts, the PTX by
    kind (``_PTX_KINDS``), the conversions, shared loads and MMAs by opcode (``ops``); with
    ``weight_bytes`` (a GEMV: the weight bytes a thread streams an iteration) each count per
    byte as well."""
    ops = _ptx_loop(kernel.asm["ptx"])
    mix = {k: sum(op.startswith(p) for op in ops) for k, p in _PTX_KINDS.items()}
    sass, local = _sass_loop(kernel)
    mix.update(ptx=len(ops), sass=sass, sass_local=local)
    if weight_bytes:
        mix.update(bytes=weight_bytes,
                   per_byte={k: round(v / weight_bytes, 3) for k, v in mix.items()})  # fmt: skip
    picked = (op for op in ops if op.startswith(("cvt", "ld.shared", "ldmatrix", "mma", "wgmma")))
    return {**mix, "ops": dict(sorted(collections.Counter(picked).items()))}


def gemv_summary(w: str, tile=(8, 2048, 8, 3), **options) -> dict:
    """``gemv_kernel(w, tile=tile, **options)``'s resources and main-loop mix."""
    kernel = gemv_kernel(w, tile=tile, **options)
    size = {"fp8e4nv": 1, "fp32": 4}.get(w, 2)
    per_thread = tile[0] * tile[1] * size // (32 * tile[2])
    return {"shared": kernel.metadata.shared, **resources(kernel),
            "loop": loop_mix(kernel, per_thread), **ptx_sync(kernel)}  # fmt: skip


def gluon_summary(kernel) -> dict:
    """A warp-specialized Gluon kernel: shared memory, the launch's registers and stack, the
    SASS's local-memory stores and loads (spills; the 2 stores at entry, if any, save the
    partitions' captured scalars), the partitions' warps and requested registers (TTGIR), the
    ``setmaxnreg`` values in the PTX, and the PTX counts of TMA copies, ``wgmma`` and
    ``wgmma.wait_group`` by depth (1: a wgmma left in flight under the softmax)."""
    ttgir, ptx = kernel.asm["ttgir"], kernel.asm["ptx"]
    sass = _on_cubin(kernel, "cuobjdump", "-sass")
    waits = re.findall(r"wgmma\.wait_group\.sync\.aligned\s+(\d+)", ptx)
    warps = re.findall(r'"ttg.num-warps" = (\d+)|num_warps\((\d+)\)', ttgir)
    regs = re.search(r"requestedRegisters = array<i32: ([^>]*)>", ttgir)[1]
    maxnreg = re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)", ptx)
    return {
        "shared": kernel.metadata.shared,
        **resources(kernel),
        "stl": len(re.findall(r"\bSTL\b", sass)),
        "ldl": len(re.findall(r"\bLDL\b", sass)),
        "partition_warps": [int(a or b) for a, b in warps],
        "requested_regs": [int(r) for r in regs.split(",")],
        "setmaxnreg": sorted({int(r) for r in maxnreg}),
        "tma_loads": len(re.findall(r"cp\.async\.bulk\.tensor", ptx)),
        "wgmma": len(re.findall(r"wgmma\.mma_async", ptx)),
        "wgmma_waits": {d: waits.count(d) for d in sorted(set(waits))},
    }


def summary(kernel) -> dict:
    ttgir, ptx = kernel.asm["ttgir"], kernel.asm["ptx"]
    # the pipelined innermost loops (the KV loops: not the Hopper path's persistent loop
    # around them, nor decode's merge of the splits, which copies nothing ahead)
    loop = ""
    for m in re.finditer("scf.for", ttgir):
        body = ttgir[m.end() : ttgir.find("scf.yield", m.end())]
        if "scf.for" not in body and "copy_global_to_local" in body:
            loop += body
    return {
        "shared": kernel.metadata.shared,
        **resources(kernel),
        "cp_async": len(re.findall(r"cp\.async\.c[ag]", ptx)),
        "tma_loads": len(re.findall(r"cp\.async\.bulk\.tensor", ptx)),
        "wgmma": len(re.findall(r"wgmma\.mma_async", ptx)),
        "mma_sync": len(re.findall(r"\bmma\.sync", ptx)),
        **pdl_order(kernel),
        "loop_loads": re.findall(r"tt\.load [^:]*: (tensor<[^>]*>)", loop),
        "loop": loop_mix(kernel),
        "inner_loops": inner_loops(kernel),
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
    "decode-bf16-few-rows": lambda: decode_kernel(  # the H200's (DecodeTuning.few_rows_tiles)
        False, tiles=decode.decode_tuning_for("H200").few_rows_tiles
    ),
    "decode-fp8": lambda: decode_kernel(True),
    "decode-fp8-fp16": lambda: decode_kernel(True, dt="fp16"),
    "decode-fp8-d256-window-softcap": lambda: decode_kernel(True, d=256, WINDOWED=True,
                                                           SOFTCAP=True),
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
    # the Hopper path over an fp8 cache (e4m3 descriptors, the scales beside): hopper_config's
    # tiles at each head dim and page, and once with a window and soft-capping
    **{f"prefill-hopper-fp8-d{d}-page{p}": functools.partial(hopper_prefill_kernel, d, p, fp8=True)
       for d in (64, 128, 256) for p in (64, 128)},
    "prefill-hopper-fp8-d256-page64-window-softcap": lambda: hopper_prefill_kernel(
        256, 64, fp8=True, WINDOWED=True, SOFTCAP=True),
    # over pools that keep a head's rows of a page together (the engine's fp8 pools of >= 64
    # tokens a page: kv_quant.head_major_pages)
    **{f"prefill-hopper-fp8-d{d}-page{p}-heads": functools.partial(
        hopper_prefill_kernel, d, p, fp8=True, HEAD_MAJOR=True)
       for d in (64, 128) for p in (64, 128)},
    "rope-fp8": lambda: rope_kernel(True),
    "rope-fp8-head-a-program": lambda: rope_kernel(True, heads=(1, 1)),
    "rope-bf16-head-a-program": lambda: rope_kernel(False, heads=(1, 1)),
}  # fmt: skip


def gluon_row(make) -> dict:
    """``gluon_summary`` of the kernel ``make()`` compiles; a note instead under a Triton other
    than 3.6, whose Gluon the kernel is written for (its API moves between versions)."""
    if not triton.__version__.startswith("3.6."):
        return {"skipped": f"written for Triton 3.6, this is {triton.__version__}"}
    return gluon_summary(make())


_GC = prefill_gluon.GluonConfig
# the Gluon kernel: its defaults (gluon_config) per head dim and page, and the alternatives that
# kernels.bench's gluon sweep times
GLUON_VARIANTS = {
    name: functools.partial(gluon_row, make)
    for name, make in {
        "gluon-prefill-d128-page128": lambda: gluon_prefill_kernel(),
        "gluon-prefill-d128-page128-2stages": lambda: gluon_prefill_kernel(cfg=_GC(128, 2)),
        "gluon-prefill-d128-page128-no-pingpong": lambda: gluon_prefill_kernel(
            cfg=_GC(128, 3, pingpong=False)),
        "gluon-prefill-d128-page64": lambda: gluon_prefill_kernel(page=64),
        "gluon-prefill-d128-page128-fp16": lambda: gluon_prefill_kernel(dt="fp16"),
        "gluon-prefill-d64": lambda: gluon_prefill_kernel(64, 64),
        "gluon-prefill-d256": lambda: gluon_prefill_kernel(256, 64),
        # the launcher's own call; last: it sets a compile-only driver
        "gluon-prefill-launch-d128-page128": lambda: gluon_launch_kernel(),
    }.items()
}  # fmt: skip
# (BLOCK_N, BLOCK_K, num_warps, num_stages): the heuristic's tiles (kernels.gemv.gemv_config) for
# bf16 weights (M = 1, M > 1) and fp8 ones: at M = 1 one warp over 16 rows (mma.sync), unsplit,
# the same over 32 rows split over K (``-split``); at M > 1 4 warps over 64 rows (wgmma); at
# every M 2 warps of 64 rows (``-mma2``)
_FP8_NARROW, _FP8_SPLIT, _FP8_WIDE = (16, 256, 1, 6), (32, 128, 1, 6), (128, 128, 2, 4)
_FP8_M8 = (64, 256, 4, 4)
GEMV_VARIANTS = {
    "gemv-bf16-m1": lambda: gemv_summary("bf16", tile=(4, 2048, 4, 3)),
    "gemv-bf16-m1-short": lambda: gemv_summary("bf16", tile=(8, 512, 4, 3)),
    "gemv-bf16-m8": lambda: gemv_summary("bf16", m=8, tile=(64, 256, 4, 3)),
    "gemv-bf16-m1-diag": lambda: gemv_summary("bf16", tile=_FP8_NARROW, diag=True),
    "gemv-bf16-m8-diag": lambda: gemv_summary("bf16", m=8, tile=_FP8_NARROW, diag=True),
    "gemv-fp8-channel-m1": lambda: gemv_summary("fp8e4nv", tile=_FP8_NARROW, w_scale=1),
    "gemv-fp8-channel-m1-split": lambda: gemv_summary("fp8e4nv", tile=_FP8_SPLIT, w_scale=1,
                                                      split=True),
    "gemv-fp8-channel-m1-mma2": lambda: gemv_summary("fp8e4nv", tile=_FP8_WIDE, w_scale=1),
    "gemv-fp8-channel-m1-fp16": lambda: gemv_summary("fp8e4nv", x="fp16", tile=_FP8_NARROW,
                                                     w_scale=1),
    "gemv-fp8-block-m1": lambda: gemv_summary("fp8e4nv", tile=_FP8_NARROW, w_scale=2),
    # x's rows in chunks (``linear_small_m(diag=True)``), against the tiles above
    "gemv-fp8-channel-m1-diag": lambda: gemv_summary("fp8e4nv", tile=_FP8_NARROW, w_scale=1,
                                                     diag=True),
    "gemv-fp8-channel-m1-split-diag": lambda: gemv_summary("fp8e4nv", tile=_FP8_SPLIT,
                                                           w_scale=1, split=True, diag=True),
    "gemv-fp8-block-m1-diag": lambda: gemv_summary("fp8e4nv", tile=_FP8_NARROW, w_scale=2,
                                                   diag=True),
    "gemv-fp8-channel-m8-narrow-diag": lambda: gemv_summary("fp8e4nv", m=8, tile=_FP8_NARROW,
                                                            w_scale=1, diag=True),
    "gemv-fp8-block-m1-mma2": lambda: gemv_summary("fp8e4nv", tile=_FP8_WIDE, w_scale=2),
    "gemv-fp8-channel-m8": lambda: gemv_summary("fp8e4nv", m=8, tile=_FP8_M8, w_scale=1),
    "gemv-fp8-channel-m8-mma2": lambda: gemv_summary("fp8e4nv", m=8, tile=_FP8_WIDE,
                                                     w_scale=1),
    "gemv-fp8-channel-m16": lambda: gemv_summary("fp8e4nv", m=16, tile=_FP8_M8, w_scale=1),
    "gemv-fp8-block-m8": lambda: gemv_summary("fp8e4nv", m=8, tile=_FP8_M8, w_scale=2),
}  # fmt: skip
# the gated MLP's gate_up with its activation in the epilogue (``linear_small_m(act=...)``;
# GELU-tanh, the costlier: libdevice's tanh), each at the tile of its ungated twin (the name
# without ``-gated``): the streaming loop must be the twin's
_G = functools.partial(gemv_summary, gated=2)
GEMV_VARIANTS.update({
    "gemv-gated-bf16-m1": lambda: _G("bf16", tile=(4, 2048, 4, 3)),
    "gemv-gated-bf16-m8": lambda: _G("bf16", m=8, tile=(64, 256, 4, 3)),
    "gemv-gated-fp8-channel-m1": lambda: _G("fp8e4nv", tile=_FP8_NARROW, w_scale=1),
    "gemv-gated-fp8-channel-m1-mma2": lambda: _G("fp8e4nv", tile=_FP8_WIDE, w_scale=1),
    "gemv-gated-fp8-block-m1": lambda: _G("fp8e4nv", tile=_FP8_NARROW, w_scale=2),
    "gemv-gated-fp8-block-m1-mma2": lambda: _G("fp8e4nv", tile=_FP8_WIDE, w_scale=2),
    "gemv-gated-fp8-block-m8": lambda: _G("fp8e4nv", m=8, tile=_FP8_M8, w_scale=2),
})  # fmt: skip


# the all-reduce of two ranks folded into the row-parallel GEMV and the norm after it
# (``kernels.fold``): each GEMV at the tile of its unfolded twin (the name without ``fold-``),
# whose streaming loop it must keep; the norms beside their unfolded twins
_F = functools.partial(gemv_summary, fold=True)
FOLD_VARIANTS = {
    "fold-gemv-bf16-m1": lambda: _F("bf16", tile=(4, 2048, 4, 3)),
    "fold-gemv-bf16-m1-short": lambda: _F("bf16", tile=(8, 512, 4, 3)),
    "fold-gemv-bf16-m8": lambda: _F("bf16", m=8, tile=(64, 256, 4, 3)),
    "fold-gemv-bf16-m1-split": lambda: _F("bf16", tile=(4, 2048, 4, 3), split=True),
    "fold-gemv-fp8-channel-m1": lambda: _F("fp8e4nv", tile=_FP8_NARROW, w_scale=1),
    "fold-norm-bf16": lambda: norm_summary(fold=True),
    "fold-norm-post-bf16": lambda: norm_summary(h=3840, fold=True, post=True),
    "fold-norm-fp32": lambda: norm_summary(dt="fp32", h=256, fold=True),  # the start-up check's
    "norm-bf16": lambda: norm_summary(),
    "norm-post-bf16": lambda: norm_summary(h=3840, post=True),
}  # fmt: skip


# the norm between two projections folded into their GEMVs over 16-bit weights
# (``linear_small_m(residual=)`` / ``(norm=)``), each at its twin's tile (the name without
# ``rownorm-`` and the part): the streaming loop must stay the twin's (the norm's: x times the
# norm's weight, nothing more)
ROWNORM_VARIANTS = {
    "rownorm-residual-gemv-bf16-m1": lambda: gemv_summary("bf16", tile=(4, 2048, 4, 3),
                                                          residual=True),
    "rownorm-residual-gemv-bf16-m1-short": lambda: gemv_summary("bf16", tile=(8, 512, 4, 3),
                                                                residual=True),
    "rownorm-residual-gemv-bf16-m8-diag": lambda: gemv_summary("bf16", m=8, tile=_FP8_NARROW,
                                                               diag=True, residual=True),
    "rownorm-norm-gemv-bf16-m1": lambda: gemv_summary("bf16", tile=(4, 2048, 4, 3), norm=True),
    "rownorm-norm-gemv-gated-bf16-m1": lambda: _G("bf16", tile=(4, 2048, 4, 3), norm=True),
    "rownorm-norm-gemv-bf16-m8-diag": lambda: gemv_summary("bf16", m=8, tile=_FP8_NARROW,
                                                           diag=True, norm=True),
    "rownorm-norm-gemv-bf16-m8": lambda: gemv_summary("bf16", m=8, tile=(64, 256, 4, 3),
                                                      norm=True),
    # ptxas left alone gave this one 96 registers and NOPs (as launched: M = 1 a constant)
    "rownorm-residual-gemv-fp8-channel-m1-diag": lambda: gemv_summary(
        "fp8e4nv", tile=_FP8_NARROW, w_scale=1, diag=True, residual=True),
}  # fmt: skip


def norm_summary(**options) -> dict:
    """``norm_kernel(**options)``'s resources, its PTX's atomics by kind (``atom.*``) and its
    loads that skip L1 (``ld.global.cg``), and where its loads stand (``load_order``)."""
    kernel = norm_kernel(**options)
    return {"shared": kernel.metadata.shared, **resources(kernel), **ptx_sync(kernel),
            **load_order(kernel)}  # fmt: skip


def load_order(kernel) -> dict:
    """A kernel's global loads (``ld.global``, and ``ld.volatile.global`` apart) before its
    first store or atomic and after it, in its PTX: loads issued before both overlap their
    round trips, where one after a store (which it might alias) or after an atomic whose
    result it needs waits for that."""
    ptx = kernel.asm["ptx"].split(".section")[0]
    first = re.search(r"\b(?:st\.global|atom\.|red\.)", ptx)
    cut = first.start() if first else len(ptx)

    def count(text: str) -> dict:
        return {"global": len(re.findall(r"\bld\.global", text)),
                "volatile": len(re.findall(r"\bld\.volatile\.global", text))}  # fmt: skip

    return {"loads": {"before_first_write": count(ptx[:cut]), "after": count(ptx[cut:])}}


def ptx_sync(kernel) -> dict:
    """What a folded kernel's ordering rests on (``kernels.fold``), in its PTX: atomics and
    reductions by opcode (``atom``/``red``; an atomic add of 0 whose result is read becomes an
    ``ld...acquire``, counted with them), loads that skip L1 (``ld.global.cg``), volatile loads
    (``ld.volatile.global``), memory fences (``fence.sc``/``fence.acq_rel``/``membar``; not
    wgmma's proxy fences), ``bar.sync``s."""
    ptx = kernel.asm["ptx"].split(".section")[0]
    atoms = collections.Counter(
        re.findall(r"\b((?:atom|red)\.[\w.]+|ld\.global\.[\w.]*acquire[\w.]*)", ptx)
    )
    return {"atom": dict(sorted(atoms.items())), "ld_cg": len(re.findall(r"ld\.global\.cg", ptx)),
            "ld_volatile": len(re.findall(r"ld\.volatile\.global", ptx)),
            "fence": len(re.findall(r"\b(?:fence\.(?:sc|acq_rel)|membar)\b", ptx)),
            "bar_sync": len(re.findall(r"bar\.sync|barrier\.sync", ptx))}  # fmt: skip


def pdl_order(kernel) -> dict:
    """The PDL protocol in a kernel's PTX: its ``griddepcontrol`` instructions in order, and
    what it does before its first wait (when the kernel before it may still run): its global
    loads by opcode (``ld.global.b32``: a 32-bit scalar a thread) and its L2 prefetches."""
    ptx = kernel.asm["ptx"].split(".section")[0]
    head = ptx.split("griddepcontrol.wait")[0]
    loads = re.findall(r"\b(ld\.global[\w.]*)", head)
    prefetches = len(re.findall(r"cp\.async\.bulk\.prefetch", head))
    return {"pdl": re.findall(r"griddepcontrol\.(wait|launch_dependents)", ptx),
            "before_wait": {"loads": loads, "l2_prefetch": prefetches}}  # fmt: skip


def fp8_configs() -> dict:
    """The decode kernel over an fp8 cache (bf16 queries, head dim 128) at each tile config
    that ``kernels.bench --kv-dtype fp8 --sweep decode-config`` times."""
    from kernels.bench import FP8_DECODE_CONFIGS

    return {f"decode-fp8-{'x'.join(map(str, c))}": functools.partial(decode_kernel, True, tiles=c)
            for c in FP8_DECODE_CONFIGS}  # fmt: skip


if __name__ == "__main__":
    if sys.argv[1:] == ["--fp8-configs"]:
        everything, prefixes = fp8_configs(), [""]
    else:
        everything = {
            **VARIANTS,
            **GLUON_VARIANTS,
            **GEMV_VARIANTS,
            **FOLD_VARIANTS,
            **ROWNORM_VARIANTS,
        }
        prefixes = sys.argv[1:] or [""]
    for name in [v for v in everything if v.startswith(tuple(prefixes))]:
        kernel_or_row = everything[name]()
        row = kernel_or_row if isinstance(kernel_or_row, dict) else summary(kernel_or_row)
        print(json.dumps({"variant": name, **row}), flush=True)
