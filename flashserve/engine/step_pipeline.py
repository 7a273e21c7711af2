"""Runs the scheduler's steps on the model runner, plainly or overlapped, isolating failures.

With ``async_scheduling`` one decode step stays queued on the device ahead of the host: while
the GPU computes step n, the host reads back step n-1 and the engine appends its tokens, checks
stops and hands the outputs on, step n+1 already queued, its input tokens taken on the device
from step n's picks. The scheduler plans that look-ahead step (``Scheduler.schedule_ahead``)
and counts it when its tokens are read (``update``), as any other. The overlap holds while the
batch stays a decode without logprobs or penalties: a row that a stop ends is computed once
more for nothing and dropped; new requests, logprobs, penalties or a full KV pool end it, and
the step after runs as ``schedule()`` plans it.

A step that fails fails only the requests it must: it runs again in halves until the failing
rows are alone, and only those fail. A failure inside the overlap drops the steps in flight
(their tokens are computed again) and re-plans, isolating the same way.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from flashserve.config import EngineConfig
from flashserve.engine.errors import EngineDeadError
from flashserve.engine.model_runner import Launched, ModelRunner, SampledToken
from flashserve.engine.scheduler import Scheduler, SchedulerOutput
from flashserve.engine.sequence import Sequence, SequenceStatus
from flashserve.sampling.sampler import Sampler

logger = logging.getLogger(__name__)


@dataclass
class StepResult:
    """What one step produced, for the engine to turn into request outputs."""

    errored: list[Sequence] = field(default_factory=list)  # can never fit (see seq.error)
    tokens: list[tuple[Sequence, SampledToken]] = field(default_factory=list)  # still running
    failed: list[tuple[Sequence, Exception]] = field(default_factory=list)  # aborted already


@dataclass
class _InFlight:
    """A step queued on the device whose tokens the host has not read yet."""

    launched: Launched
    sched: SchedulerOutput  # the scheduler's plan, or its look-ahead step


class StepPipeline:
    """One ``step()`` at a time: schedule, run (or queue) on the runner, collect tokens."""

    def __init__(self, config: EngineConfig, scheduler: Scheduler, runner: ModelRunner):
        self.config = config
        self.scheduler = scheduler
        self.runner = runner
        self.in_flight: _InFlight | None = None

    def step(self) -> StepResult:
        """The tokens of one step. With async scheduling a decode step's tokens come from the
        ``step()`` call after the one that queued it."""
        prev = self.in_flight
        if prev is not None:
            try:
                self.in_flight = self._queue_next(prev)
                return StepResult(tokens=self._collect(prev))
            except EngineDeadError:
                raise
            except Exception:
                logger.exception("a queued step failed: running the batch again, step by step")
                self.drop()
                return self._run_isolating(self.scheduler.schedule())
        sched = self.scheduler.schedule()
        if not (self.config.async_scheduling and overlappable(sched)):
            return self._run_isolating(sched)
        try:
            launched = self.runner.launch(sched.seqs)
        except EngineDeadError:
            raise
        except Exception:
            logger.exception("launching a step failed: running it again, step by step")
            return self._run_isolating(sched)
        self.in_flight = _InFlight(launched, sched)
        return StepResult(errored=sched.errored)

    def drop(self) -> None:
        """Forget the steps queued ahead: nothing of them is appended or counted, so the next
        plan computes the same tokens again (their tokens, if they ever land, go nowhere)."""
        self.in_flight = None
        self.scheduler.unschedule()

    def _queue_next(self, prev: _InFlight) -> _InFlight | None:
        """Queue the look-ahead step after ``prev`` before reading ``prev``'s tokens, if the
        scheduler plans one."""
        nxt = self.scheduler.schedule_ahead(prev.sched)
        if nxt is None:
            return None
        return _InFlight(self.runner.launch(nxt.seqs, prev.launched, nxt.ahead_rows), nxt)

    def _collect(self, fl: _InFlight) -> list[tuple[Sequence, SampledToken]]:
        """Read a queued step's tokens and count it; the tokens of the sequences still running
        (not stopped by an earlier token, or aborted, while it ran)."""
        tokens = fl.launched.tokens()
        self.scheduler.update(fl.sched)
        running = SequenceStatus.RUNNING
        return [(s, t) for s, t in zip(fl.sched.seqs, tokens) if s.status is running]

    def _run_isolating(self, sched: SchedulerOutput) -> StepResult:
        """Run ``sched`` now and count it; the sequences whose rows fail even alone are
        aborted, the others go on as if nothing had happened (a retried row computes the same
        K/V into the same slots, and samples the same token: its noise depends only on its
        seed and position)."""
        if sched.is_empty:
            return StepResult(errored=sched.errored)
        done, failed = self._execute_isolating(sched.seqs)
        for seq, _ in failed:
            self.scheduler.abort(seq.seq_id)
        gone = {seq.seq_id for seq, _ in failed}
        self.scheduler.update(SchedulerOutput(seqs=[s for s in sched.seqs if s.seq_id not in gone]))
        return StepResult(sched.errored, done, failed)

    def _execute_isolating(
        self, seqs: list[Sequence]
    ) -> tuple[list[tuple[Sequence, SampledToken]], list[tuple[Sequence, Exception]]]:
        """(sequence, token) for the sampling rows of ``seqs`` that ran, and (sequence, error)
        for those that fail even alone. A failed batch is split in halves (each keeps the
        decodes-first order), so one bad row among N costs about 2 log2(N) extra steps."""
        try:
            tokens = self.runner.execute(seqs)
        except EngineDeadError:
            raise
        except Exception as exc:
            self._check_device(exc)
            if len(seqs) == 1:
                return [], [(seqs[0], exc)]
            logger.warning("a step of %d sequences failed (%s: %s): running it in halves",
                           len(seqs), type(exc).__name__, exc)  # fmt: skip
            mid = len(seqs) // 2
            done_a, failed_a = self._execute_isolating(seqs[:mid])
            done_b, failed_b = self._execute_isolating(seqs[mid:])
            return done_a + done_b, failed_a + failed_b
        return list(zip([s for s in seqs if s.samples_this_step], tokens)), []

    def _check_device(self, exc: Exception) -> None:
        """Raise ``EngineDeadError`` if ``exc`` left the CUDA context unusable (a device-side
        assert poisons it: every later call fails), or a tensor-parallel rank died, where
        retrying cannot help."""
        self.runner.check_alive()
        if not self.config.is_cuda:
            return
        try:
            torch.cuda.synchronize(self.config.device)
        except Exception as dead:
            raise EngineDeadError(f"the CUDA device failed: {dead}") from exc


def overlappable(sched: SchedulerOutput) -> bool:
    """A step the engine may queue without waiting: some sequence runs, each computes its last
    token and samples the next (a one-token prefill chunk that samples nothing is not one),
    with no logprobs or penalties (the sampler needs no token the host has not read)."""
    seqs = sched.seqs
    return (
        bool(seqs)
        and sched.num_decodes == len(seqs)
        and all(s.samples_this_step for s in seqs)
        and Sampler.overlappable(seqs)
    )
