"""Shared pieces of the benchmarks: percentiles, progress, tables, JSON and run metadata."""

from __future__ import annotations

import datetime
import json
import math
import platform
import sys
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")


def percentiles(values: Sequence[float], qs: Iterable[int] = (50, 90, 99)) -> dict[str, float]:
    """``{"p50": ..., "p90": ..., "p99": ...}`` by linear interpolation; NaN when empty."""
    xs = sorted(values)
    out = {}
    for q in qs:
        if not xs:
            out[f"p{q}"] = math.nan
            continue
        pos = (len(xs) - 1) * q / 100
        lo, hi = math.floor(pos), math.ceil(pos)
        out[f"p{q}"] = xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)
    return out


def progress(items: Sequence[T], desc: str, enabled: bool = True) -> Iterator[T]:
    """``items`` with a tqdm bar on stderr when tqdm is installed, else a line per item."""
    if not enabled:
        yield from items
        return
    try:
        from tqdm import tqdm
    except ImportError:
        for i, item in enumerate(items):
            print(f"[{desc}] {i + 1}/{len(items)}", file=sys.stderr, flush=True)
            yield item
        return
    yield from tqdm(items, desc=desc, file=sys.stderr)


class Counter:
    """A progress counter for work that completes out of order (tqdm or plain prints);
    ``total`` None: not known in advance."""

    def __init__(self, total: int | None, desc: str, enabled: bool = True):
        self.total, self.desc, self.done, self.enabled = total, desc, 0, enabled
        self._bar = None
        if enabled:
            try:
                from tqdm import tqdm

                self._bar = tqdm(total=total, desc=desc, file=sys.stderr)
            except ImportError:
                pass

    def update(self) -> None:
        self.done += 1
        if self._bar is not None:
            self._bar.update(1)
        elif self.enabled and (
            self.done % (max(1, self.total // 10) if self.total else 100) == 0
            or self.done == self.total
        ):
            print(f"[{self.desc}] {self.done}/{self.total or '?'}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain-text table, columns right-aligned."""
    cells = [[_fmt(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    # the first column (a name or the first key) to the left, numbers to the right
    line = lambda r: "  ".join(
        c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))
    )
    return "\n".join([line(headers), line(["-" * w for w in widths]), *map(line, cells)])


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if math.isnan(value):
            return "-"
        return f"{value:.3g}" if abs(value) < 100 else f"{value:,.0f}"
    return str(value)


def run_metadata() -> dict[str, Any]:
    """Versions, machine and date, for the record of a run."""
    import torch

    import flashserve

    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "flashserve": flashserve.__version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "host": platform.node(),
        "cpu": platform.processor() or platform.machine(),
        "device_name": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
    }
    try:
        import transformers

        meta["transformers"] = transformers.__version__
    except ImportError:
        meta["transformers"] = None
    return meta


def publish(result: dict[str, Any], table_text: str, json_path: str | None) -> None:
    """Print a benchmark's table (and why its peer did not run, if it did not); write the
    whole result as JSON when asked."""
    print(table_text)
    if result["meta"].get("peer_note"):
        print(f"peer: {result['meta']['peer_note']}")
    if json_path:
        write_json(json_path, result)


def write_json(path: str, data: dict[str, Any]) -> None:
    """``data`` as indented JSON; NaN becomes null."""
    Path(path).write_text(json.dumps(_clean(data), indent=2) + "\n")


def _clean(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    return x


def require_matplotlib() -> None:
    """Fail before a run, not after it, when ``--plot`` cannot be honoured."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as exc:
        from flashserve.cli.args import CLIError

        raise CLIError(
            "--plot needs matplotlib: pip install matplotlib (or 'flashserve[bench]')", status=2
        ) from exc


def pyplot():
    """matplotlib's pyplot on the Agg backend."""
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
