"""The folded all-reduce's kernels (``kernels.fold``) compile for sm_90 without a GPU, keep
the GEMV's streaming loop, and carry what the module doc argues from: no fence and no
system-scope atomic, the GEMV's call counter read past L1, the norm's GPU-scope add to it and
its volatile reads of the row's tagged words.
Counts from tests/sm90_compile.py."""

from __future__ import annotations

import pytest
from compile_reports import sm90_reports


@pytest.fixture(scope="module")
def compiled() -> dict[str, dict]:
    return sm90_reports("fold", "norm", "gemv-bf16", "gemv-fp8-channel-m1")


def test_every_folded_kernel_compiles_without_spills(compiled):
    folded = [name for name in compiled if name.startswith("fold-")]
    assert len(folded) == 8, folded
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
    """Tagged words (``kernels.fold``): no fence and no atomic at system scope anywhere; the
    GEMV reads the call counter past L1, the norm adds to it at GPU scope and re-reads its
    row's words with volatile loads."""
    for name, row in compiled.items():
        atoms = row["atom"]
        sys_ops = {op: n for op, n in atoms.items() if ".sys." in op}
        assert not sys_ops and row["fence"] == 0, (name, atoms, row["fence"])
        if not name.startswith("fold-"):  # (a split GEMV reads its partial sums past L1)
            assert row["ld_cg"] == 0 or "-split" in name, (name, row)
            assert row["ld_volatile"] == 0, name
            continue
        if name.startswith("fold-gemv-"):
            assert row["ld_cg"] >= 1, name  # the call counter, read past L1
            assert not atoms or "-split" in name, (name, atoms)  # the split's tile counter
        else:  # the counter's add, the row's words read volatile (before the spin and in it)
            assert atoms == {"atom.global.gpu.relaxed.add.u64": 1}, (name, atoms)
            assert row["ld_volatile"] >= 2, (name, row["ld_volatile"])


def test_the_norms_issue_every_load_before_they_write_or_wait(compiled):
    """The norm kernels load x, the residual and the weights before their first store or
    atomic (a load after a store it might alias waits for it: one round trip to L2 after
    another), and the folded ones both slots' words too, beside the counter's add that picks
    one; only the spin re-reads (volatile) one slot after it."""
    for name in [n for n in compiled if n.startswith(("norm-", "fold-norm-"))]:
        before, after = (
            compiled[name]["loads"]["before_first_write"],
            compiled[name]["loads"]["after"],
        )
        assert before["global"] >= 2 and after["global"] == 0, (name, before, after)
        if name.startswith("fold-"):
            assert before["volatile"] == 2 * after["volatile"] > 0, (name, before, after)
