"""How rank 0 hands each step's host inputs (its ``StepPlan``) to the other ranks.

One ZeroMQ PUB socket on rank 0, one SUB socket per worker, MessagePack (msgspec) frames:

- rank 0 never waits for the workers to take a step: a send only queues the frame (libzmq's
  own thread writes it), so with async scheduling rank 0 queues step n+1 while the workers
  still read step n, as it does on one GPU. A collective (gloo's ``broadcast_object_list``)
  would hold rank 0 until every worker reached it, and costs two collectives a step (size,
  then bytes);
- one send serves every worker, over TCP: on localhost, or from another host under torchrun
  (the address travels through the rendezvous store);
- the plan is a few flat lists of ints: msgspec encodes them with no pickling of Python
  objects and decodes them into a ``StepPlan`` (without the ``Sequence`` objects, which only
  rank 0's sampler reads).

A subscriber that connects late would miss what was sent before (PUB drops frames nobody
subscribed to): rank 0's XPUB socket reports each subscription, and ``wait_for`` holds the
start-up until every worker's has arrived. Frames are then delivered in order, never dropped
(no high-water mark).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import msgspec
import zmq

from flashserve.engine.step_plan import StepPlan


class WireStep(msgspec.Struct, array_like=True, gc=False):
    """A ``StepPlan`` less its ``Sequence`` objects; ``stop``: the worker's loop ends."""

    input_ids: list[int]
    positions: list[int]
    slot_mapping: list[int]
    seq_lens: list[int]
    q_lens: list[int]
    block_tables: list[list[int]]
    num_decodes: int
    sample_rows: list[int]
    ahead: bool
    eager: bool = False
    stop: bool = False


STOP = WireStep([], [], [], [], [], [], 0, [], False, stop=True)


class StepSender:
    """Rank 0's end: bound on ``bind_host`` (a free port), reached at ``address``."""

    def __init__(self, bind_host: str, advertised_host: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.XPUB)
        self.sock.setsockopt(zmq.SNDHWM, 0)  # never drop, never block
        self.sock.setsockopt(zmq.XPUB_VERBOSE, 1)  # report every subscription, repeats too
        self.sock.setsockopt(zmq.LINGER, 0)
        port = self.sock.bind_to_random_port(f"tcp://{bind_host}")
        self.address = f"tcp://{advertised_host}:{port}"
        self._encode = msgspec.msgpack.Encoder().encode

    def wait_for(self, subscribers: int, check: Callable[[], None], timeout: float) -> None:
        """Until ``subscribers`` workers have subscribed; ``check()`` runs between polls (it
        raises when a worker died); TimeoutError after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        seen = 0
        while seen < subscribers:
            check()
            if time.monotonic() > deadline:
                raise TimeoutError(f"{seen} of {subscribers} tensor-parallel workers reached "
                                   f"the step channel in {timeout:.0f} s")  # fmt: skip
            if self.sock.poll(100):
                seen += self.sock.recv()[:1] == b"\x01"  # \x01: subscribe, \x00: leave

    def send(self, plan: StepPlan) -> None:
        msg = WireStep(plan.input_ids, plan.positions, plan.slot_mapping, plan.seq_lens,
                       plan.q_lens, plan.block_tables, plan.num_decodes, plan.sample_rows,
                       plan.ahead, plan.eager)  # fmt: skip
        self.sock.send(self._encode(msg), copy=False)

    def stop(self) -> None:
        self.sock.send(self._encode(STOP))

    def close(self, linger_ms: int = 1000) -> None:
        self.sock.close(linger=linger_ms)  # the STOP frame still goes out
        self.ctx.term()


class StepReceiver:
    """A worker's end, connected to rank 0's ``address``."""

    def __init__(self, address: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.RCVHWM, 0)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self._decode = msgspec.msgpack.Decoder(WireStep).decode

    def recv(self) -> StepPlan | None:
        """The next step's plan; None when rank 0 says stop."""
        msg = self._decode(self.sock.recv(copy=False).buffer)
        if msg.stop:
            return None
        return StepPlan(msg.input_ids, msg.positions, msg.slot_mapping, msg.seq_lens,
                        msg.q_lens, msg.block_tables, msg.num_decodes, msg.sample_rows,
                        sampling=[], ahead=msg.ahead, eager=msg.eager)  # fmt: skip

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()
