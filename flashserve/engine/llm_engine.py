"""The engine: requests in, one scheduled step at a time, tokens out.

``LLMEngine`` is single-threaded; ``LLM`` drives it to completion for a list of prompts;
``flashserve.engine.async_llm.AsyncLLM`` runs it on its own thread for the server.

With ``async_scheduling`` the engine keeps one decode step queued on the device ahead of the
host: while the GPU computes step n, the host reads back step n-1, appends its tokens, checks
stops and hands the outputs on, having already queued step n+1, whose input tokens the device
takes from step n's picks. That holds while the batch stays a decode without logprobs or
penalties: a row that a stop ends is computed once more for nothing and dropped; new requests,
logprobs, penalties or a full KV pool end the overlap, and the step after runs as
``schedule()`` plans it.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from flashserve.config import EngineConfig
from flashserve.engine.block_manager import BlockManager
from flashserve.engine.model_runner import Launched, ModelRunner, SampledToken
from flashserve.engine.outputs import Completion, RequestOutput, TokenOutput
from flashserve.engine.prompts import PromptChecker
from flashserve.engine.scheduler import Scheduler, SchedulerOutput
from flashserve.engine.sequence import FinishReason, Sequence, SequenceStatus
from flashserve.engine.stop_strings import StopMatcher
from flashserve.loaders.load import load_model
from flashserve.sampling.params import SamplingParams
from flashserve.sampling.sampler import Sampler
from flashserve.tokenizer.detokenizer import IncrementalDetokenizer

logger = logging.getLogger(__name__)
# what a client sees when its own request fails in the engine (the log has the details)
REQUEST_FAILED = "the engine could not compute this request; the server log has the details"


class EngineDeadError(RuntimeError):
    """The engine cannot go on (its CUDA context failed): every request fails, and the
    process should be restarted."""


@dataclass
class Request:
    """A validated request, ready to join the engine: its sequence plus output state."""

    request_id: str
    seq: Sequence
    detokenizer: IncrementalDetokenizer
    stops: StopMatcher  # fed every text delta while the request runs
    text: str = ""
    stop_string_hit: bool = False


@dataclass
class _InFlight:
    """A step queued on the device whose tokens the host has not read yet."""

    launched: Launched
    sched: SchedulerOutput | None  # the scheduler's plan, or None for a step queued ahead of it


class LLMEngine:
    """Owns the model runner, block manager and scheduler; ``step()`` runs one batch."""

    def __init__(self, config: EngineConfig | None = None):
        self.config = config or EngineConfig()
        loaded = load_model(
            self.config.model,
            self.config.device,
            self.config.torch_dtype,
            self.config.attention_backend,
            self.config.seed,
        )
        self.model_name = loaded.name
        self.model_config = loaded.config
        self.tokenizer = loaded.tokenizer
        self.runner = ModelRunner(self.config, loaded.model, loaded.config)
        self.max_model_len = self.runner.max_model_len
        self.prompts = PromptChecker(self.tokenizer, loaded.config.vocab_size, self.max_model_len)
        self.block_manager = BlockManager(self.runner.num_blocks, self.config.block_size)
        self.scheduler = Scheduler(self.config, self.block_manager)
        self.requests: dict[str, Request] = {}
        self._by_seq: dict[int, Request] = {}
        self._seed_rng = random.Random(self.config.seed)
        self._in_flight: _InFlight | None = None

    # ---- requests --------------------------------------------------------------------------

    def make_request(
        self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None
    ) -> Request:
        """Tokenize and validate; raises ValueError naming the problem. Changes no state."""
        ids = self.prompts.checked_ids(prompt, params)
        if params.seed is None:
            params = dataclasses.replace(params, seed=self._seed_rng.randrange(2**63))
        seq = Sequence(ids, params)
        detok = IncrementalDetokenizer(self.tokenizer, ids, params.skip_special_tokens)
        stops = StopMatcher(params.stop)  # O(total stop length): here, off the event loop
        return Request(request_id or uuid.uuid4().hex, seq, detok, stops)

    def check_text_fits(self, text: str) -> None:
        """``PromptChecker.check_text_fits``: ValueError if ``text`` cannot fit the context."""
        self.prompts.check_text_fits(text)

    def add(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        self.requests[req.request_id] = req
        self._by_seq[req.seq.seq_id] = req
        self.scheduler.add(req.seq)

    def add_request(
        self, prompt: str | list[int], params: SamplingParams | None = None,
        request_id: str | None = None,
    ) -> str:  # fmt: skip
        req = self.make_request(prompt, params or SamplingParams(), request_id)
        self.add(req)
        return req.request_id

    def abort(self, request_id: str) -> RequestOutput | None:
        req = self.requests.get(request_id)
        if req is None:
            return None
        self.scheduler.abort(req.seq.seq_id)
        return self._close(req, FinishReason.ABORT, [])

    def fail_all(self, error: str) -> list[RequestOutput]:
        """Finish every request with an error (after a failed step); the engine carries on."""
        self._in_flight = None  # its tokens, if it ever completes, go nowhere
        outs = []
        for req in list(self.requests.values()):
            self.scheduler.abort(req.seq.seq_id)
            outs.append(self._fail(req, error))
        return outs

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # ---- one step ----------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule, run the model, append the sampled tokens; outputs of requests that got a
        token (or finished). With ``async_scheduling``, the outputs of a decode step come from
        the ``step()`` call after the one that queued it.

        A step that fails fails only the requests it must (``_run_isolating``): the step is
        run again in halves until the failing rows are alone, and only those end with an
        error. A failure inside the async pipeline drops the steps in flight (their tokens are
        computed again) and runs the next step plainly, isolating the same way."""
        prev = self._in_flight
        if prev is not None:
            try:
                self._in_flight = self._queue_next(prev)
                return self._collect(prev)
            except Exception:
                logger.exception("a queued step failed: running the batch again, step by step")
                self._drop_in_flight()
                return self._run_isolating(self.scheduler.schedule())
        sched = self.scheduler.schedule()
        if self.config.async_scheduling and _overlappable(sched):
            outputs = self._errored(sched)
            try:
                launched = self.runner.launch(sched.seqs, self.runner.prepare(sched.seqs))
            except Exception:
                logger.exception("launching a step failed: running it again, step by step")
                return outputs + self._run_isolating(dataclasses.replace(sched, errored=[]))
            self._in_flight = _InFlight(launched, sched)
            return outputs
        return self._run_isolating(sched)

    def _errored(self, sched: SchedulerOutput) -> list[RequestOutput]:
        """Outputs of the sequences the scheduler finished because they can never fit."""
        return [self._fail(self._by_seq[s.seq_id], s.error) for s in sched.errored]

    def _run_isolating(self, sched: SchedulerOutput) -> list[RequestOutput]:
        """Run ``sched`` now and append its tokens; the requests whose rows fail even alone
        end with an error, the others go on as if nothing had happened (a retried row computes
        the same K/V into the same slots, and samples the same token: its noise depends only
        on its seed and position)."""
        outputs = self._errored(sched)
        if sched.is_empty:
            return outputs
        done, failed = self._execute_isolating(sched.seqs)
        for seq, exc in failed:
            req = self._by_seq[seq.seq_id]
            logger.error("request %s failed in the engine, alone: %s: %s",
                         req.request_id, type(exc).__name__, exc)  # fmt: skip
            self.scheduler.abort(seq.seq_id)
            outputs.append(self._fail(req, REQUEST_FAILED))
        gone = {seq.seq_id for seq, _ in failed}
        ok = [s for s in sched.seqs if s.seq_id not in gone]
        self.scheduler.update(SchedulerOutput(seqs=ok))
        outputs += [self._append_or_fail(self._by_seq[s.seq_id], t) for s, t in done]
        return outputs

    def _execute_isolating(
        self, seqs: list[Sequence]
    ) -> tuple[list[tuple[Sequence, SampledToken]], list[tuple[Sequence, Exception]]]:
        """(sequence, token) for the sampling rows of ``seqs`` that ran, and (sequence, error)
        for those that fail even alone. A failed batch is split in halves (each keeps the
        decodes-first order), so one bad row among N costs about 2 log2(N) extra steps."""
        try:
            tokens = self.runner.execute(seqs)
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
        assert poisons it: every later call fails), where retrying cannot help."""
        if not self.config.is_cuda:
            return
        try:
            torch.cuda.synchronize(self.config.device)
        except Exception as dead:
            raise EngineDeadError(f"the CUDA device failed: {dead}") from exc

    def _drop_in_flight(self) -> None:
        """Forget the steps queued ahead: their sequences are unscheduled, with nothing of
        those steps appended, so the next plan computes the same tokens again."""
        self._in_flight = None
        for seq in self.scheduler.running:
            seq.num_scheduled_tokens = 0

    def _queue_next(self, prev: _InFlight) -> _InFlight | None:
        """Queue the decode step after ``prev`` before reading ``prev``'s tokens: for every
        sequence of ``prev`` still running that its token cannot take to a length limit. None
        (the overlap ends) when requests wait to be admitted, a running sequence is not in
        ``prev``, or the KV pool lacks a block."""
        sched = self.scheduler
        if sched.num_waiting:
            return None
        seqs = prev.launched.seqs
        if sum(s.status is SequenceStatus.RUNNING for s in seqs) != sched.num_running:
            return None
        # prev's token is the one not appended yet: after it a sequence holds num_tokens + 1
        rows = [i for i, s in enumerate(seqs) if s.status is SequenceStatus.RUNNING
                and s.num_output_tokens + 1 < s.params.max_new_tokens
                and s.num_tokens + 1 < self.max_model_len]  # fmt: skip
        if not rows:
            return None
        nxt = [seqs[i] for i in rows]
        bm = self.block_manager
        if sum(bm.blocks_to_hold(s, s.num_tokens + 1) for s in nxt) > bm.num_free_blocks:
            return None
        for s in nxt:
            bm.grow(s, s.num_tokens + 1)
        host = self.runner.prepare_ahead(nxt, rows)
        return _InFlight(self.runner.launch(nxt, host, prev.launched), None)

    def _collect(self, fl: _InFlight) -> list[RequestOutput]:
        """Read a queued step's tokens and append them to the sequences still running."""
        tokens = fl.launched.tokens()
        if fl.sched is not None:
            self.scheduler.update(fl.sched)
        outputs = []
        for seq, tok in zip(fl.launched.seqs, tokens):
            if seq.status is not SequenceStatus.RUNNING:
                continue  # stopped by an earlier token, or aborted, while this step ran
            if fl.sched is None:
                seq.num_computed_tokens += 1
            outputs.append(self._append_or_fail(self._by_seq[seq.seq_id], tok))
        return outputs

    def _append_or_fail(self, req: Request, tok: SampledToken) -> RequestOutput:
        """``_append``; if the host side of one request fails (detokenizing, stop checks), that
        request ends with an error and the others of the step go on."""
        try:
            return self._append(req, tok)
        except Exception:
            logger.exception("request %s failed after its token was sampled", req.request_id)
            if req.seq.status is not SequenceStatus.FINISHED:
                self.scheduler.abort(req.seq.seq_id)
            return self._fail(req, REQUEST_FAILED)

    def _fail(self, req: Request, error: str | None) -> RequestOutput:
        out = self._close(req, FinishReason.ERROR, [])
        out.error = error
        return out

    def _append(self, req: Request, tok: SampledToken) -> RequestOutput:
        seq = req.seq
        seq.append_token(tok.token_id, tok.logprob)
        delta = req.detokenizer.add(tok.token_id)
        req.text += delta
        special = self.tokenizer.is_special(tok.token_id)
        text = self.tokenizer.convert_ids_to_tokens([tok.token_id])[0] if special else delta
        token = TokenOutput(tok.token_id, text, tok.logprob, special, self._top(tok))
        reason = self._stop_reason(req, tok.token_id, delta)
        if reason is None:
            return self._output(req, [token], False, None)
        if not req.stop_string_hit:
            req.text += req.detokenizer.flush()  # bytes that never formed a character
        self.scheduler.finish(seq, reason)
        return self._close(req, reason, [token])

    def _top(self, tok: SampledToken) -> list[tuple[int, str, float]] | None:
        if tok.top is None:
            return None
        return [(i, self.tokenizer.decode([i], skip_special_tokens=False), lp) for i, lp in tok.top]

    def _stop_reason(self, req: Request, token_id: int, delta: str) -> str | None:
        seq, params = req.seq, req.seq.params
        if not params.ignore_eos and token_id in self.tokenizer.eos_token_ids:
            return FinishReason.EOS
        if token_id in params.stop_token_ids:
            return FinishReason.STOP
        if params.stop and self._cut_stop_string(req, delta):
            return FinishReason.STOP
        if seq.num_output_tokens >= params.max_new_tokens or seq.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    def _cut_stop_string(self, req: Request, delta: str) -> bool:
        """Find a stop string that this token's text ``delta`` completed; cut the output
        before it (before the earliest-starting one, when the text completed several)."""
        at = req.stops.feed(delta)
        if at is None:
            return False
        req.text = req.text[:at]
        req.stop_string_hit = True
        return True

    def _close(self, req: Request, reason: str, tokens: list[TokenOutput]) -> RequestOutput:
        self.requests.pop(req.request_id, None)
        self._by_seq.pop(req.seq.seq_id, None)
        return self._output(req, tokens, True, reason)

    def _output(self, req: Request, tokens, finished: bool, reason: str | None) -> RequestOutput:
        seq = req.seq
        return RequestOutput(
            request_id=req.request_id,
            new_tokens=tokens,
            finished=finished,
            finish_reason=reason,
            generated_text=req.text,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_generated_tokens=seq.num_output_tokens,
            seed=seq.params.seed,
            prompt_token_ids=seq.prompt_token_ids,
            held_back=0 if finished else req.stops.held_back,
        )


def _overlappable(sched: SchedulerOutput) -> bool:
    """A step the engine may queue without waiting: every sequence computes its last token and
    samples the next (a one-token prefill chunk that samples nothing is not one), with no
    logprobs or penalties (the sampler needs no token the host has not read)."""
    seqs = sched.seqs
    return (
        sched.num_decodes == len(seqs)
        and all(s.samples_this_step for s in seqs)
        and Sampler.overlappable(seqs)
    )


class LLM:
    """Synchronous generation for a list of prompts, batched by the engine."""

    def __init__(self, config: EngineConfig | None = None, **kwargs):
        self.engine = LLMEngine(config or EngineConfig(**kwargs))
        self.tokenizer = self.engine.tokenizer

    def generate(
        self,
        prompts: str | list[int] | list[str | list[int]],
        params: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[Completion]:
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        plist = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(plist)} sampling params")
        reqs = [self.engine.make_request(p, sp) for p, sp in zip(prompts, plist)]
        for req in reqs:
            self.engine.add(req)
        while self.engine.has_unfinished():
            self.engine.step()
        return [_completion(r) for r in reqs]

    def stream(self, prompt: str | list[int], params: SamplingParams | None = None
               ) -> Iterator[RequestOutput]:  # fmt: skip
        """Outputs of one request as they come (the CLI's ``generate``)."""
        rid = self.engine.add_request(prompt, params or SamplingParams())
        while self.engine.has_unfinished():
            for out in self.engine.step():
                if out.request_id == rid:
                    yield out


def _completion(req: Request) -> Completion:
    seq = req.seq
    return Completion(
        request_id=req.request_id,
        prompt_token_ids=seq.prompt_token_ids,
        token_ids=list(seq.output_token_ids),
        text=req.text,
        finish_reason=seq.finish_reason,
        logprobs=list(seq.output_logprobs),
        seed=seq.params.seed,
    )
