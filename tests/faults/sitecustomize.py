"""Fault injection for tests/test_engine_process.py, in a real server's engine core process,
and for tests/test_tp_engine.py, in a tensor-parallel worker.

With this folder on PYTHONPATH, Python imports this module at start-up in every process of
the server; it acts only in the engine core process (multiprocessing's spawned child, which
Python starts with ``--multiprocessing-fork``) and only when FLASHSERVE_TEST_CORE_FAULT is set
to N: from the N-th message with new tokens on, the core's loop raises outside the step's own
guard, as a bug in the loop would, and the process dies with it.
"""

import os
import sys

_AFTER = os.environ.get("FLASHSERVE_TEST_CORE_FAULT")

if _AFTER and "--multiprocessing-fork" in sys.argv:
    from flashserve.engine.core import EngineCore

    _publish = EngineCore._publish
    _calls = [0]

    def _broken_publish(self, outputs):
        _calls[0] += any(o.new_tokens for o in outputs)
        if _calls[0] >= int(_AFTER):
            raise RuntimeError("injected: the engine core loop broke")
        return _publish(self, outputs)

    EngineCore._publish = _broken_publish

if os.environ.get("FLASHSERVE_TEST_TP_WORKER_FAULT") and "--multiprocessing-fork" in sys.argv:
    # a spawned tensor-parallel worker fails to load its share of the model
    from flashserve.engine import tp_worker

    def _broken_load(config, group, store):
        raise RuntimeError(f"injected: rank {group.rank} cannot load its share")

    tp_worker._load = _broken_load
