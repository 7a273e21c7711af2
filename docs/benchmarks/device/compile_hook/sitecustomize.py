"""Every kernel Triton compiles (an in-memory cache miss), with the time and its specialization
key, one line each, appended to the file that ``COMPILE_LOG`` names: put this folder first on
``PYTHONPATH`` of a server (its engine process inherits it) and compare the times with the
moment the server was ready (``stall.sh`` does). Python imports ``sitecustomize`` at start-up;
without ``COMPILE_LOG`` this does nothing. Session 34 found with it which decode kinds compiled
in the middle of serving (``docs/benchmarks/serving.md``)."""

import os
import sys
import time

if os.environ.get("COMPILE_LOG"):
    try:
        import triton

        def _log_compile(*args, **kwargs):
            name = kwargs.get("repr", "?").split("[", 1)[0]
            key = str(kwargs.get("compile", {}).get("key", "")).replace("\n", " ")
            with open(os.environ["COMPILE_LOG"], "a") as f:
                f.write(f"{time.time():.3f} {os.getpid()} {name} {key}\n")
            return False  # compile as usual

        triton.knobs.runtime.jit_cache_hook = _log_compile
    except (ImportError, AttributeError) as e:  # a Triton without the hook
        sys.stderr.write(f"compile_hook: {e!r}\n")
