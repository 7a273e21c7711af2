"""The typed attention backend: its operations, and the metadata it alone builds, for a step run
eagerly (``prepare_metadata``) and for captured decode graphs (``graph_buffers``,
``capture_metadata``, ``replay_metadata``), from one ``StepPlan``."""

from __future__ import annotations

import random

import pytest
import torch

from flashserve.engine.sequence import Sequence
from flashserve.engine.staging import Staging
from flashserve.engine.step_plan import StepPlan
from flashserve.models.attention import BACKEND_OPS, AttentionBackend, TorchBackend, load_backend

BS = 4


def _seq(num_tokens: int, computed: int, scheduled: int, blocks: list[int]) -> Sequence:
    seq = Sequence(list(range(10, 10 + num_tokens)))
    seq.num_computed_tokens, seq.num_scheduled_tokens, seq.block_table = computed, scheduled, blocks
    return seq


def test_backends_are_typed_and_complete():
    backend = load_backend("torch")
    assert isinstance(backend, AttentionBackend) and backend.name == "torch"
    assert all(callable(getattr(backend, op)) for op in BACKEND_OPS)
    with pytest.raises(ValueError, match="unknown attention backend"):
        load_backend("flash")

    class Partial(TorchBackend):
        def _ops(self):
            return {op: fn for op, fn in super()._ops().items() if op != "decode_attention"}

    with pytest.raises(TypeError, match="decode_attention"):
        Partial()


def test_eager_metadata_splits_decodes_from_prefill_chunks():
    """Two decodes, then a prefill chunk over cached context and a whole prompt: one upload,
    tables split at the decodes (views; 16 columns, zero padded), each part's lengths 16-byte
    aligned, query offsets of the chunks; the decodes' length hint of a mixed step."""
    seqs = [
        _seq(6, 5, 1, [7, 3]),  # decode at position 5
        _seq(9, 8, 1, [1, 4, 8]),  # decode at position 8
        _seq(11, 4, 5, [2, 6, 9]),  # chunk: positions 4..8
        _seq(3, 0, 3, [5]),  # a prompt
    ]
    plan = StepPlan.build(seqs, BS)
    assert plan.num_decodes == 2 and plan.sample_rows == [0, 1, 9] and plan.table_width == 3
    staging = Staging("cpu")
    up = staging.begin()
    meta = load_backend("torch").prepare_metadata(plan, up)
    up.send()
    assert staging.num_copies == 1
    slots = [3 * BS + 1, 8 * BS, 6 * BS, 6 * BS + 1, 6 * BS + 2, 6 * BS + 3, 9 * BS, 20, 21, 22]
    assert meta.slot_mapping.tolist() == slots
    assert (meta.num_decode_tokens, meta.num_prefill_tokens) == (2, 8)
    assert meta.decode_seq_lens.tolist() == [6, 9] and meta.max_decode_seq_len == 9
    pad = [0] * 13
    assert meta.decode_block_tables.tolist() == [[7, 3, 0] + pad, [1, 4, 8] + pad]
    assert meta.prefill_cu_seqlens_q.tolist() == [0, 5, 8]
    assert meta.prefill_seq_lens.tolist() == [9, 3] and meta.max_prefill_seq_len == 9
    assert meta.prefill_block_tables.tolist() == [[2, 6, 9] + pad, [5, 0, 0] + pad]
    assert meta.max_prefill_query_len == 5
    tables = meta.decode_block_tables
    assert meta.prefill_block_tables.data_ptr() == tables.data_ptr() + 2 * 16 * 4  # one [B, M]
    assert meta.decode_seq_lens.data_ptr() % 16 == 0 == meta.prefill_seq_lens.data_ptr() % 16
    # beside decode graphs, the decodes of a mixed step take the graphs' length hint
    hinted = load_backend("torch").prepare_metadata(plan, staging.begin(), mixed_decode_len=4096)
    assert hinted.max_decode_seq_len == 4096 and hinted.max_prefill_seq_len == 9
    assert hinted.decode_seq_lens.tolist() == [6, 9]
    decodes = StepPlan.build(seqs[:2], BS)  # a decode-only step keeps its own longest
    alone = load_backend("torch").prepare_metadata(decodes, staging.begin(), mixed_decode_len=4096)
    assert alone.max_decode_seq_len == 9 and alone.prefill_seq_lens is None


def test_eager_tables_keep_one_stride_kind_for_every_width():
    """The eager tables' row stride, an integer argument of every attention kernel, is a
    multiple of 16 for any longest table: Triton sees one kind (no compile for a new width)."""
    for longest in [1, 2, 15, 16, 17, 31, 32, 33, random.randint(34, 5000)]:
        seqs = [_seq(longest * BS, longest * BS - 1, 1, list(range(longest))),
                _seq(3, 0, 3, [longest])]  # fmt: skip
        plan = StepPlan.build(seqs, BS)
        up = Staging("cpu").begin()
        meta = load_backend("torch").prepare_metadata(plan, up)
        up.send()
        tables = meta.decode_block_tables
        width = tables.stride(0)
        assert width % 16 == 0 and longest <= width < longest + 16, (longest, width)
        assert tables[0, :longest].tolist() == list(range(longest))
        assert meta.prefill_block_tables[0].tolist() == [longest] + [0] * (width - 1)


def test_graph_tables_have_the_eager_tables_stride_kind():
    """The decode graphs' block tables are as wide as max_model_len's blocks in the eager
    steps' columns: a multiple of 16, so a kernel compiled at the capture serves an eager
    step's decodes (a mixed step's) and no kind is left to compile mid-serving (a GPU server
    under a mixed load compiled the decode kernel three times after start-up with the graphs'
    stride of another kind: docs/benchmarks/serving.md, session 34)."""
    from types import SimpleNamespace

    from flashserve.engine.cuda_graph import graph_layout

    backend = load_backend("torch")
    for max_len in [1, 100, 2048, 40_000, random.randint(2, 200_000)]:
        for block in (16, 64, 128):
            runner = SimpleNamespace(config=SimpleNamespace(max_num_seqs=8), backend=backend,
                                     max_model_len=max_len, block_size=block)  # fmt: skip
            _, width, specs = graph_layout(runner)
            blocks = -(-max_len // block)
            assert width % 16 == 0 and blocks <= width < blocks + 16, (max_len, block, width)
            assert specs["block_tables"] == ((8, width), torch.int32)


def test_graph_hooks_capture_static_buffers_and_replay_writes_them():
    backend = load_backend("torch")
    spill = Staging("cpu")
    staging = Staging("cpu", 1024, backend.graph_buffers(8, 16), spill=spill)
    static = staging.fixed
    captured = backend.capture_metadata(static, 4, max_seq_len=64)
    assert captured.max_decode_seq_len == 64 and captured.num_prefill_tokens == 0
    assert captured.decode_seq_lens.data_ptr() == static["seq_lens"].data_ptr()
    assert captured.decode_block_tables.shape == (4, 16) and captured.prefill_cu_seqlens_q is None
    seqs = [_seq(6, 5, 1, [7, 3]), _seq(2, 1, 1, [4])]
    plan = StepPlan.build(seqs, BS)
    up = staging.begin()
    backend.replay_metadata(plan, 4, up)
    up.send()
    assert staging.num_copies == 1 and spill.num_copies == 0
    # what the captured metadata reads now: two rows, then two padding rows
    assert captured.slot_mapping.tolist() == [3 * BS + 1, 4 * BS + 1, -1, -1]
    assert captured.decode_seq_lens.tolist() == [6, 2, 1, 1]
    assert captured.decode_block_tables[:2, :2].tolist() == [[7, 3], [4, 0]]
    assert captured.decode_block_tables[2:].tolist() == [[0] * 16] * 2  # valid ids: block 0
    ahead = StepPlan.build(seqs, BS, rows=[1, 0])  # the look-ahead step after it
    assert ahead.input_ids == [1, 0] and ahead.positions == [6, 2] and ahead.seq_lens == [7, 3]
    assert ahead.slot_mapping == [3 * BS + 2, 4 * BS + 2] and ahead.ahead and ahead.is_decode
    assert torch.equal(captured.slot_mapping, static["slot_mapping"][:4])


def test_triton_kernels_in_mixed_steps_give_the_torch_backends_tokens(monkeypatch):
    """An engine on the Triton kernels (Triton's interpreter here, float32), its mixed steps'
    decodes planned by the decode graphs' length hint as a GPU runner with graphs plans them
    (``ModelRunner.mixed_decode_len``), and prompts chunked beside decodes (a 64-token budget,
    16-token blocks): the same greedy tokens as the torch backend."""
    from flashserve.config import EngineConfig
    from flashserve.engine.llm_engine import LLM
    from flashserve.sampling.params import SamplingParams

    lens = [random.randint(20, 60), random.randint(150, 260), random.randint(2, 9)]
    prompts = [torch.randint(5, 200, (n,)).tolist() for n in lens]
    params = SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True)
    tokens, hints = {}, []
    for backend in ("torch", "triton"):
        llm = LLM(EngineConfig(model="dummy:tiny", device="cpu", dtype="float32",
                               attention_backend=backend, enforce_eager=True, block_size=16,
                               max_num_batched_tokens=64, max_kv_tokens=4096, max_num_seqs=4,
                               warm_up=False))  # fmt: skip
        runner = llm.engine.runner
        assert runner.mixed_decode_len == 0  # no graphs: no hint
        runner.mixed_decode_len = runner.max_model_len
        prepare = runner.backend.prepare_metadata

        def watched(plan, upload, mixed_decode_len=0, prepare=prepare, backend=backend):
            meta = prepare(plan, upload, mixed_decode_len)
            if meta.num_decode_tokens and meta.num_prefill_tokens:
                hints.append((backend, meta.max_decode_seq_len))
            return meta

        monkeypatch.setattr(runner.backend, "prepare_metadata", watched)
        tokens[backend] = [out.token_ids for out in llm.generate(prompts, params)]
    # mixed steps ran on both, each planned by the hint
    hint = llm.engine.runner.max_model_len
    assert hint > max(lens) + 6 and {h for _, h in hints} == {hint}
    assert {b for b, _ in hints} == {"torch", "triton"}
    assert tokens["triton"] == tokens["torch"]
