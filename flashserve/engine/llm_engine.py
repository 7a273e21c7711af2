"""The engine: requests in, one scheduled step at a time, tokens out.

``LLMEngine`` is single-threaded; ``LLM`` drives it to completion for a list of prompts;
``flashserve.engine.async_llm.AsyncLLM`` runs it on its own thread for the server. The steps
themselves, plain or overlapped (``async_scheduling``), and the isolation of failing requests
are ``flashserve.engine.step_pipeline``'s; the engine turns their tokens into outputs. On a
GPU it runs a few requests of its own before it is ready (``EngineConfig.warm_up``), so that
the first user's prompt does not wait for kernels to compile.

With ``tensor_parallel_size`` N > 1 the engine's process is rank 0 of N: it starts the other
ranks (``flashserve.engine.tp_workers``), loads its own share of the model while they load
theirs, and its runner hands every step to them; ``close()`` stops them.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from flashserve.config import EngineConfig
from flashserve.engine.block_manager import BlockManager
from flashserve.engine.messages import EngineStats
from flashserve.engine.model_runner import ModelRunner, SampledToken
from flashserve.engine.outputs import Completion, RequestOutput, TokenOutput
from flashserve.engine.prompts import PromptChecker
from flashserve.engine.scheduler import Scheduler
from flashserve.engine.sequence import FinishReason, Sequence, SequenceStatus
from flashserve.engine.step_pipeline import EngineDeadError, StepPipeline, StepResult
from flashserve.engine.stop_strings import StopMatcher
from flashserve.engine.tp_workers import TPWorkers
from flashserve.loaders.load import check_tensor_parallel, load_model
from flashserve.models.sharding import SINGLE
from flashserve.sampling.params import SamplingParams
from flashserve.tokenizer.detokenizer import IncrementalDetokenizer
from kernels.gemv import rows_compiled_apart

__all__ = ["LLM", "REQUEST_FAILED", "EngineDeadError", "LLMEngine", "Request"]
logger = logging.getLogger(__name__)
# what a client sees when its own request fails in the engine (the log has the details)
REQUEST_FAILED = "the engine could not compute this request; the server log has the details"


@dataclass
class Request:
    """A validated request, ready to join the engine: its sequence plus output state."""

    request_id: str
    seq: Sequence
    detokenizer: IncrementalDetokenizer
    stops: StopMatcher  # fed every text delta while the request runs
    text: str = ""
    stop_string_hit: bool = False


class LLMEngine:
    """Owns the model runner, block manager and scheduler; ``step()`` runs one batch."""

    def __init__(self, config: EngineConfig | None = None):
        self.config = config or EngineConfig()
        workers = None
        if self.config.tensor_parallel_size > 1:  # a model that cannot split fails first
            check_tensor_parallel(self.config.model, self.config.tensor_parallel_size,
                                  self.config.quantization)  # fmt: skip
            workers = TPWorkers.start(self.config)
        try:
            loaded = load_model(
                self.config.model,
                self.config.device,
                self.config.torch_dtype,
                self.config.attention_backend,
                self.config.seed,
                pdl_chain=self.config.pdl_chain,
                prefill_path=self.config.prefill_path,
                quantization=self.config.quantization,
                tp=workers.group if workers is not None else SINGLE,
            )
            if workers is not None:
                workers.wait_loaded()
            self.runner = ModelRunner(self.config, loaded.model, loaded.config, workers)
            if workers is not None:
                workers.wait_ready()
        except BaseException:
            if workers is not None:
                workers.close()
            raise
        self.model_name = loaded.name
        self.model_config = loaded.config
        self.tokenizer = loaded.tokenizer
        self.max_model_len = self.runner.max_model_len
        self.prompts = PromptChecker(self.tokenizer, loaded.config.vocab_size, self.max_model_len)
        self._seed_rng = random.Random(self.config.seed)
        self._new_state()
        if self.config.warm_up:
            try:
                self._warm_up()
            except BaseException:
                self.close()
                raise
            self._new_state()

    def _new_state(self) -> None:
        """An empty block manager, scheduler and step pipeline, and no requests."""
        self.block_manager = BlockManager(
            self.runner.num_blocks,
            self.config.block_size,
            window=self.model_config.kv_window,
            prefix_caching=self.config.enable_prefix_caching,
        )
        self.scheduler = Scheduler(self.config, self.block_manager, self.max_model_len)
        self.pipeline = StepPipeline(self.config, self.scheduler, self.runner)
        self.requests: dict[str, Request] = {}
        self._by_seq: dict[int, Request] = {}

    def _warm_up(self) -> None:
        """Requests through the normal path before the engine is ready
        (``EngineConfig.warm_up``), so that the kernels the first prompts need are compiled
        here. Triton compiles a kernel again for each kind of the integer arguments it
        specializes (1, a multiple of 16, anything else; the prefill kernels take the step's
        tiles and prompts unspecialized, ``kernels.common.PREFILL_STEP_INTS``, and the eager
        steps' tables are padded to one kind of width). The warm-up meets: a greedy prompt of
        twice the step budget and 273 tokens alone (chunks of 16 tiles, the first alone, the
        others over cached KV, then one of 3 tiles), and one of twice the budget and 17 (its
        last chunk a tile over 4K tokens: the prefill kernel over parts of the keys,
        ``kernels.prefill.prefill_kv_splits``, as a prompt found in the prefix cache but for
        its last tokens meets); a prompt of 273 tokens and a sampled one of
        17 together; two short ones together, greedy and sampled. The GEMVs of 2-16 rows compile
        apart at the row counts ``kernels.gemv.rows_compiled_apart`` gives (2, 3, 5, 9, 16), and
        the decode graphs meet only their buckets' counts, so for each such n it runs a prompt
        of n tokens alone (the projections at n rows; 1 tile, a chat's first turn: a TGI
        ``/generate`` of "Hello there" on a byte-level vocabulary is 12) and n prompts of two
        tokens together (the LM head at n rows, and a step of n prompts; prompts of one token
        would make a decode-shaped step, which replays a decode graph) where ``max_num_seqs``
        lets n run at once. Each gets two tokens out (one where the context holds no more:
        decode batches of one and more, greedy, sampled and mixed), and its own token repeated
        as its prompt (no prompt starts like another, so none is served from the prefix cache);
        the prompts are shorter where the context is. It runs on throwaway state (``__init__``
        makes it afresh after), with its own seeds, so that the pool, the prefix cache, the
        counters and unseeded requests' seeds are as without it. A server's first request of
        31,000 tokens at TP=2 on a fresh pair of H200s: 10.9 s to its first token without it,
        0.70 s with it (p50 of three: 0.65), after 15.9 s of warm-up at start-up
        (docs/benchmarks/serving.md, sessions 30-31)."""
        if self.max_model_len < 2:  # no room for a prompt and a token
            return
        start = time.perf_counter()
        longest = self.max_model_len - 2
        greedy, sampled = 0.0, 1.0
        rows = rows_compiled_apart()[1:]
        budget = self.config.max_num_batched_tokens
        groups = (
            ((2 * budget + 273, greedy),),
            ((2 * budget + 17, greedy),),  # a last chunk of one tile: the keys in parts
            *(((n, greedy),) for n in rows),
            *(((2, greedy),) * n for n in rows if n <= self.config.max_num_seqs),
            ((273, greedy), (17, sampled)),
            ((17, greedy), (17, sampled)),
        )
        made, shown = 0, []
        for group in groups:
            lens = [max(1, min(n, longest)) for n, _ in group]
            same = len(group) > 1 and len(set(group)) == 1  # one prompt, n times
            shown.append(f"{len(lens)} x {lens[0]}" if same else " + ".join(map(str, lens)))
            for i, (n, (_, temperature)) in enumerate(zip(lens, group)):
                out_len = min(2, self.max_model_len - n)
                params = SamplingParams(max_new_tokens=out_len, temperature=temperature,
                                        ignore_eos=True, seed=i)  # fmt: skip
                # a token of its own per request: no prompt reuses another's cached blocks
                token = made % self.model_config.vocab_size
                self.add(self.make_request([token] * n, params, f"warm-up {made}"))
                made += 1
            while self.has_unfinished():
                for out in self.step():
                    if out.error:
                        raise RuntimeError(f"the start-up warm-up request failed: {out.error}")
        logger.info("warm-up: %d requests in %.1f s, prompt tokens by group: %s", made,
                    time.perf_counter() - start, "; ".join(shown))  # fmt: skip

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
        self.pipeline.drop()
        outs = []
        for req in list(self.requests.values()):
            self.scheduler.abort(req.seq.seq_id)
            outs.append(self._fail(req, error))
        return outs

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def stats(self, now: float, gpu_memory: tuple[int, int] | None) -> EngineStats:
        """The gauges at ``now`` (the caller's ``time.monotonic()``), with the allocator's
        ``gpu_memory`` that the caller samples at its own rate."""
        scheduler = self.scheduler
        return EngineStats(
            time=now,
            running=scheduler.num_running,
            waiting=scheduler.num_waiting,
            kv_usage=self.block_manager.usage(),
            preemptions=scheduler.num_preemptions,
            prefix_cache_queries=scheduler.prefix_cache_queries,
            prefix_cache_hits=scheduler.prefix_cache_hits,
            unfinished=len(self.requests),
            gpu_memory=gpu_memory,
        )

    def check_alive(self) -> None:
        """EngineDeadError once the engine cannot go on (a tensor-parallel rank died); the
        engine loops call it while idle too, so that a death is reported without a request."""
        self.runner.check_alive()

    def close(self) -> None:
        """Stop the tensor-parallel workers, if any (the engine cannot step after this)."""
        self.runner.close()

    def prompt_logits(self, token_ids: list[int]) -> Iterator[torch.Tensor]:
        """Teacher forcing: prefill ``token_ids`` as one sequence through the normal path, in
        chunks of the step budget (``max_num_batched_tokens``), so that its K/V go into the
        cache in its dtype (fp8 too) and each chunk attends to the cached ones before it; yield
        each chunk's logits ``[n, V]`` float32, positions in order (row i predicts token i +
        1). The engine must be idle; the sequence's blocks go back to the pool at the end."""
        if self.has_unfinished():
            raise RuntimeError("prompt_logits needs an idle engine (requests are running)")
        seq = Sequence(self.prompts.checked_ids(token_ids, SamplingParams(max_new_tokens=1)))
        self.block_manager.allocate(seq, seq.num_tokens)
        try:
            budget = self.config.max_num_batched_tokens
            while seq.num_computed_tokens < seq.num_tokens:
                seq.num_scheduled_tokens = min(budget, seq.num_tokens - seq.num_computed_tokens)
                yield self.runner.every_logits([seq])
                seq.num_computed_tokens += seq.num_scheduled_tokens
        finally:
            seq.num_scheduled_tokens = 0
            self.block_manager.free(seq)

    # ---- one step ----------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule, run the model, append the sampled tokens; outputs of requests that got a
        token (or finished). With ``async_scheduling``, the outputs of a decode step come from
        the ``step()`` call after the one that queued it. A step that fails fails only the
        requests whose rows fail alone (``StepPipeline``)."""
        return self._outputs(self.pipeline.step())

    def _outputs(self, result: StepResult) -> list[RequestOutput]:
        outputs = [self._fail(self._by_seq[s.seq_id], s.error) for s in result.errored]
        for seq, exc in result.failed:
            req = self._by_seq[seq.seq_id]
            logger.error("request %s failed in the engine, alone: %s: %s",
                         req.request_id, type(exc).__name__, exc)  # fmt: skip
            outputs.append(self._fail(req, REQUEST_FAILED))
        outputs += [self._append_or_fail(self._by_seq[s.seq_id], t) for s, t in result.tokens]
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
            num_cached_tokens=seq.num_cached_tokens,
        )


class LLM:
    """Synchronous generation for a list of prompts, batched by the engine."""

    def __init__(self, config: EngineConfig | None = None, **kwargs):
        self.engine = LLMEngine(config or EngineConfig(**kwargs))
        self.tokenizer = self.engine.tokenizer

    def close(self) -> None:
        """Stop the tensor-parallel workers, if any."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

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
