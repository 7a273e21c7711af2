"""The folded all-reduce's kernels (``kernels.fold``) compile for sm_90 without a GPU, keep
the GEMV's streaming loop, and carry the ordering the module doc argues from: the GEMV one
release reduction at system scope a program (after a barrier), the norm acquire reads at
system scope of its flag, a GPU-scope add to its counter and the peer's slot read past L1.
Counts from tests/sm90_compile.py."""

from __future__ import annotations

import pytest
from compile_reports import sm90_reports


@pytest.fixture(scope="module")
def compiled() -> dict[str, dict]:
    return sm90_reports("fold", "norm", "gemv-bf16", "gemv-fp8-channel-m1")


def test_every_folded_kernel_compiles_without_spills(compiled):
    folded = [name for name in compiled if name.startswith("fold-")]
    assert len(folded) == 6, folded
    for name in folded:
        row = compiled[name]
        assert row["stack_bytes"] + row["local_bytes"] == 0, (name, row)
        assert row["regs"] <= 255, (name, row)


def test_the_folded_gemv_streams_as_its_twin_does(compiled):
    """The fold touches the epilogue only: the K loop's SASS per weight byte within 1% of the
    unfolded kernel's at the same tile, the same MMAs."""
    for name in [n for n in compiled if n.startswith("fold-gemv-")]:
        twin = compiled[name.removeprefix("fold-").removesuffix("-split")]["loop"]
        loop = compiled[name]["loop"]
        assert loop["per_byte"]["sass"] <= 1.01 * twin["per_byte"]["sass"], (name, loop, twin)
        assert (loop["mma"], loop["wgmma"]) == (twin["mma"], twin["wgmma"]), name


def test_the_ordering_the_fold_rests_on_is_in_the_ptx(compiled):
    for name, row in compiled.items():
        atoms = row["atom"]
        sys_ops = {op: n for op, n in atoms.items() if ".sys." in op}
        if not name.startswith("fold-"):  # (a split GEMV reads its partial sums past L1)
            assert not sys_ops and (row["ld_cg"] == 0 or "-split" in name), (name, atoms)
            continue
        if name.startswith("fold-gemv-"):  # one release at system scope, after a barrier
            assert sys_ops == {"red.global.sys.release.add.u64": 1}, (name, atoms)
            assert row["ld_cg"] >= 1, name  # the call counter, read past L1
        else:  # acquire reads of the flag (before the spin and in it), the counter's add
            assert sys_ops == {"ld.global.sys.acquire.b64": 2}, (name, atoms)
            assert atoms.get("atom.global.gpu.relaxed.add.u64") == 1, (name, atoms)
            assert row["ld_cg"] >= 1, name  # the peer's slot, read past L1
        assert row["bar_sync"] >= 1, name
