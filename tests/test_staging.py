"""The staging of a step's host-to-device copies (``flashserve.engine.staging``): whatever a
step adds and puts, of any dtype, arrives intact in one copy; a staging that is too small grows
(or spills) instead of failing. On the CPU the "device" buffer is a second host buffer, so the
copy and its byte range are the same code as on CUDA."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flashserve.engine.staging import ALIGN, Staging

FIXED = {
    "ids": ((8,), torch.int64),
    "lens": ((8,), torch.int32),
    "tables": ((64, 256), torch.int32),
}


def _graph_staging(dynamic: int = 4096) -> tuple[Staging, Staging]:
    spill = Staging("cpu", dynamic=256)
    return Staging("cpu", dynamic=dynamic, fixed=FIXED, spill=spill), spill


def test_adds_of_every_dtype_arrive_in_one_copy():
    staging = Staging("cpu", dynamic=1024)
    up = staging.begin()
    ids = up.add([3, 1, 2**40], torch.int64)
    floats = up.add(np.array([[0.5, 1e-3], [2.0, 3.25]], dtype=np.float32), torch.float32)
    lens = up.add([7, 8, 9, 10, 11], torch.int32)  # 20 bytes: the next array stays aligned
    table = up.add_rows([[5, 6], [7], []], 3)
    empty = up.add([], torch.int64)
    assert staging.num_copies == 0  # nothing travels before send
    up.send()
    assert staging.num_copies == 1
    assert ids.tolist() == [3, 1, 2**40] and ids.dtype == torch.int64
    assert floats.tolist() == [[0.5, np.float32(1e-3)], [2.0, 3.25]] and floats.shape == (2, 2)
    assert lens.tolist() == [7, 8, 9, 10, 11] and lens.dtype == torch.int32
    assert table.tolist() == [[5, 6, 0], [7, 0, 0], [0, 0, 0]]  # zero padded rows
    assert empty.numel() == 0
    for t in (ids, floats, lens, table):
        assert t.data_ptr() % ALIGN == 0


def test_the_next_upload_reuses_the_buffer_and_leaves_sent_values_alone():
    """The copy is taken at send: a later upload's writes reach only its own tensors."""
    staging = Staging("cpu", dynamic=1024)
    first = staging.begin()
    a = first.add([1, 2, 3], torch.int64)
    first.send()
    second = staging.begin()
    b = second.add([4, 5, 6], torch.int64)
    assert a.tolist() == [1, 2, 3]  # the device side holds what was sent
    second.send()
    assert b.tolist() == [4, 5, 6] and staging.num_copies == 2


def test_puts_and_adds_travel_together():
    staging, spill = _graph_staging()
    fixed = staging.fixed
    up = staging.begin()
    up.put("ids", [11, 12, 13])
    up.put("lens", [5, 6, 7, 1])
    up.put_rows("tables", [[1, 2], [3], [4, 5, 6]], 3)
    temps = up.add(np.array([0.7, 1.0], dtype=np.float32), torch.float32)
    up.send()
    assert staging.num_copies == 1 and spill.num_copies == 0
    assert fixed["ids"][:3].tolist() == [11, 12, 13] and fixed["lens"][:4].tolist() == [5, 6, 7, 1]
    assert fixed["tables"][:3, :3].tolist() == [[1, 2, 0], [3, 0, 0], [4, 5, 6]]
    assert temps.tolist() == pytest.approx([0.7, 1.0])
    assert fixed["ids"].data_ptr() > temps.data_ptr()  # adds sit below the fixed tensors


def test_rows_of_a_mostly_empty_span_go_dense_and_land_in_place():
    """40 rows 2 wide in a table 256 wide: the span (39 * 256 + 2 entries) is mostly tails,
    so the rows travel dense and the device copies them in; everything else stays."""
    staging, _ = _graph_staging()
    tables = staging.fixed["tables"]
    tables.fill_(-7)
    rows = [[i, i + 100] for i in range(40)]
    up = staging.begin()
    up.put_rows("tables", rows, 2)
    up.send()
    assert tables[:40, :2].tolist() == rows and staging.num_copies == 1
    assert (tables[:, 2:] == -7).all() and (tables[40:] == -7).all(), "a value outside moved"


def test_rows_spanning_little_tail_travel_as_they_lie():
    """Two rows 60 wide: their span goes in the one copy, rows below them untouched."""
    staging, _ = _graph_staging()
    tables = staging.fixed["tables"]
    tables.fill_(-7)
    rows = [list(range(60)), list(range(1, 61))]
    up = staging.begin()
    up.put_rows("tables", rows, 60)
    up.send()
    assert tables[:2, :60].tolist() == rows and staging.num_copies == 1
    assert (tables[1, 60:] == -7).all() and (tables[2:] == -7).all()


def test_a_staging_too_small_grows_and_the_next_upload_fits():
    staging = Staging("cpu", dynamic=64)
    up = staging.begin()
    small = up.add([1, 2], torch.int64)
    big = up.add(list(range(1000)), torch.int64)  # 8 KB: outgrows the area
    after = up.add([9], torch.int32)
    up.send()
    assert (small.tolist(), big.tolist(), after.tolist()) == ([1, 2], list(range(1000)), [9])
    assert staging.num_copies == 2  # this step: the old area and the new one
    up = staging.begin()
    again = [up.add(list(range(1000)), torch.int64), up.add([1, 2], torch.int64)]
    up.send()
    assert staging.num_copies == 3 and again[0].tolist() == list(range(1000))


def test_a_graph_staging_spills_what_its_room_cannot_hold():
    staging, spill = _graph_staging(dynamic=64)
    up = staging.begin()
    up.put("ids", [1])
    fits = up.add([1, 2, 3], torch.int64)
    spilled = up.add(list(range(500)), torch.int64)
    up.send()
    assert fits.tolist() == [1, 2, 3] and spilled.tolist() == list(range(500))
    assert staging.fixed["ids"][0].item() == 1
    assert (staging.num_copies, spill.num_copies) == (1, 1)
    assert spilled.untyped_storage().data_ptr() != fits.untyped_storage().data_ptr()


def test_fixed_tensors_need_a_spill():
    with pytest.raises(ValueError, match="spill"):
        Staging("cpu", fixed=FIXED)
