"""Two tensor-parallel ranks for model-level tests: this process is rank 0, a spawned helper
rank 1, joined once in a gloo group (spawning a process that imports torch takes seconds on
a small CPU: a module shares one pair).

``RankPair.run(fn, *args)`` runs ``fn(group, *args)`` on both ranks at once (``fn`` a
module-level function of this module, which the helper imports) and returns rank 0's result.
If either rank fails, the other would wait in a collective: the helper exits at once (rank 0's
collective then fails on the closed connection), and a failure on rank 0 kills the helper.

``greedy_logits`` is what both ranks run: a model's share loaded through ``load_model``, a
prompt prefilled, then greedy decode steps, through a paged cache (``model_utils``).
"""

from __future__ import annotations

import multiprocessing
import os
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from model_utils import block_tables, make_kv_caches, run_chunks

from flashserve.engine.parallel import TPGroup
from flashserve.loaders.load import load_model
from flashserve.models.sharding import TPComm

REPLY_TIMEOUT_S = 300.0


class RankPair:
    def __init__(self) -> None:
        store = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False)
        ctx = multiprocessing.get_context("spawn")
        self.conn, theirs = ctx.Pipe()
        self.proc = ctx.Process(target=_helper, args=(store.port, theirs), daemon=True)
        self.proc.start()
        theirs.close()
        self.group = TPGroup.join(store, 0, 2, "cpu")
        self.store = store

    def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        self.conn.send((fn, args))
        try:
            mine = fn(self.group, *args)
        except BaseException:
            if self.proc.is_alive() and self.conn.poll(2.0):  # the helper's error says more
                ok, theirs = self.conn.recv()
                if not ok:
                    self.close()
                    raise AssertionError(f"rank 1 failed:\n{theirs}") from None
            self.close()
            raise
        if not self.conn.poll(REPLY_TIMEOUT_S):
            self.close()
            raise AssertionError("rank 1 did not answer")
        ok, theirs = self.conn.recv()
        if not ok:
            self.close()
            raise AssertionError(f"rank 1 failed:\n{theirs}")
        return mine

    def close(self) -> None:
        if self.proc.is_alive():
            try:
                self.conn.send(None)
            except OSError:
                pass
            self.proc.join(10)
            if self.proc.is_alive():
                self.proc.kill()
                self.proc.join()
        self.group.destroy()


def _helper(port: int, conn) -> None:
    torch.set_num_threads(1)  # rank 0 has the test process's threads; the CPU is small
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=False)
    group = TPGroup.join(store, 1, 2, "cpu")
    while (job := conn.recv()) is not None:
        fn, args = job
        try:
            conn.send((True, fn(group, *args) is not None))
        except BaseException:
            conn.send((False, traceback.format_exc()))
            os._exit(1)  # rank 0 may wait in a collective: the closed connection ends it
    group.destroy()


BLOCK = 4  # KV block size: sequences cross many blocks


@torch.no_grad()
def greedy_logits(
    tp: TPComm, spec: str, prompt: list[int], steps: int, max_model_len: int | None = None,
    quantization: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor, list]:  # fmt: skip
    """Rank ``tp.rank``'s share of model ``spec`` (float32, torch backend; ``quantization``
    as ``load_model`` takes it): the logits of the prompt's tokens ``[L, V]`` (one prefill),
    those of each greedy decode step ``[steps, V]`` (the first: the prompt's last), and the
    greedy tokens."""
    model = load_model(spec, "cpu", torch.float32, "torch", quantization=quantization, tp=tp).model
    if max_model_len:
        model.ensure_positions(max_model_len)
    gen = torch.Generator().manual_seed(1)
    table, num_blocks = block_tables([len(prompt) + steps], BLOCK, shuffle=True, gen=gen)
    caches = make_kv_caches(model, num_blocks, BLOCK)
    full = run_chunks(model, caches, table, [(prompt, 0)], BLOCK)[0]
    logits, tokens = [full[-1]], []
    for i in range(steps):
        tokens.append(int(logits[-1].argmax()))
        if i < steps - 1:
            step = [([tokens[-1]], len(prompt) + i)]
            logits.append(run_chunks(model, caches, table, step, BLOCK)[0][0])
    return full, torch.stack(logits), tokens


def check_runner_collectives(tp: TPComm, blocks: list[int], tokens: list[int]) -> bool:
    """On every rank: the KV pool's block count agreed as the ranks' smallest (rank r offers
    ``blocks[r]``), and rank 0's look-ahead tokens broadcast into every rank's buffer."""
    assert tp.min_int(blocks[tp.rank]) == min(blocks)
    ids = torch.tensor(tokens if tp.rank == 0 else [-1] * len(tokens), dtype=torch.int64)
    assert tp.broadcast_(ids).tolist() == tokens
    return True


def check_fp8_share(tp: TPComm, spec: str, quantization: str | None) -> bool:
    """On every rank: its share of model ``spec`` holds exactly its part (``tensor_shard``)
    of each parameter of the one-rank model, float8 weights and their scales bit for bit."""
    whole = dict(load_model(spec, "cpu", torch.float32, "torch", quantization=quantization)
                 .model.named_parameters())  # fmt: skip
    share = load_model(spec, "cpu", torch.float32, "torch", quantization=quantization, tp=tp)
    fp8 = 0
    for name, p in share.model.named_parameters():
        w = whole[name]
        want = share.model.tensor_shard(name, tuple(w.shape)).take(w)
        assert p.dtype == w.dtype and p.shape == want.shape, (name, p.shape, want.shape)
        if p.dtype == torch.float8_e4m3fn:
            p, want, fp8 = p.view(torch.uint8), want.view(torch.uint8), fp8 + 1
        assert torch.equal(p, want), name
    assert fp8 == 4 * share.config.num_hidden_layers  # qkv, o, gate_up, down
    return True
