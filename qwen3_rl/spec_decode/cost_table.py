"""Measured cost of a speculative verification step (``sam_config.cost_table``, switch ``SAM_COST_TABLE``).

A cost table is a JSON file of measured step times, one row per shape and grid cell::

    {"rows": [{"model": "qwen3-32b-tp8", "B": 8, "k": 3, "ctx": 8192, "step_ms": 17.9, "ratio_to_k0": 1.04}, ...]}

``model`` names the shape (a model, or one TP shard of it), ``B`` the running requests of the step, ``k`` the draft
tokens each verifies (``B * (k + 1)`` query tokens), ``ctx`` the context tokens per request, ``step_ms`` the time of
the step (ms); ``ratio_to_k0`` (optional) is ``step_ms`` over the same cell's ``k = 0`` time. Other keys are ignored.
Per shape the rows must form a full grid B x k x ctx with ``k = 0`` in it (the format the H100 measurement
``verify_cost.py`` writes; ``../shared/bench/README.md``).

Pricing a step (:meth:`CostTable.step_ms`): ``n`` running requests, ``query_tokens`` in all (``n`` plus every draft
token; requests may draft different lengths), ``ctx`` context tokens per request. The table is interpolated piecewise
linearly along each axis in (B, q, ctx), ``q = query_tokens / n`` the mean query tokens per request (``1 + k`` on the
grid): at the grid's cells the result is the measured time. Outside the grid, B and ctx are clamped to its edges (the
nearest measured cell) and q beyond the longest draft continues the last segment's slope (never falling).

A spec names a file and, when it holds several shapes, the shape: ``FILE`` or ``FILE@SHAPE``. Every problem with a
file is one :class:`CostTableError` line naming the file.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from numba import njit

from qwen3_rl.spec_decode._sam_kernels import CACHE

RATIO_TOLERANCE = 0.01  # a row's ratio_to_k0 may differ this much (relative) from step_ms / step_ms(k = 0)


class CostTableError(ValueError):
    """A cost table that cannot be used (one line, naming the file)."""


@njit(cache=CACHE)
def _bracket(grid, x):  # pragma: no cover - numba
    """Index ``i`` and weight ``w`` with ``x ~ (1 - w) * grid[i] + w * grid[i + 1]``, clamped to the grid."""
    n = grid.shape[0]
    if n == 1 or x <= grid[0]:
        return 0, 0.0
    if x >= grid[n - 1]:
        return n - 2, 1.0
    i = 0
    while grid[i + 1] < x:
        i += 1
    return i, (x - grid[i]) / (grid[i + 1] - grid[i])


@njit(cache=CACHE)
def curve_into(b_grid, c_grid, ms, n, ctx, out):  # pragma: no cover - numba
    """Step time (ms) at every k of the grid for ``n`` requests of ``ctx`` context tokens each, into ``out``
    (float64[nk]): bilinear in (B, ctx), clamped to the grid."""
    ib, wb = _bracket(b_grid, n)
    ic, wc = _bracket(c_grid, ctx)
    jb = min(ib + 1, b_grid.shape[0] - 1)
    jc = min(ic + 1, c_grid.shape[0] - 1)
    for k in range(ms.shape[1]):
        lo = (1.0 - wc) * ms[ib, k, ic] + wc * ms[ib, k, jc]
        hi = (1.0 - wc) * ms[jb, k, ic] + wc * ms[jb, k, jc]
        out[k] = (1.0 - wb) * lo + wb * hi


@njit(cache=CACHE)
def price(q_grid, curve, q):  # pragma: no cover - numba
    """Step time (ms) at ``q`` mean query tokens per request on a curve (``curve_into``) over ``q_grid`` = 1 + k:
    piecewise linear; below the grid its first value, beyond it the last segment's slope (at least 0)."""
    n = q_grid.shape[0]
    if q <= q_grid[0]:
        return curve[0]
    if q >= q_grid[n - 1]:
        slope = (curve[n - 1] - curve[n - 2]) / (q_grid[n - 1] - q_grid[n - 2])
        return curve[n - 1] + max(slope, 0.0) * (q - q_grid[n - 1])
    i = 0
    while q_grid[i + 1] < q:
        i += 1
    w = (q - q_grid[i]) / (q_grid[i + 1] - q_grid[i])
    return (1.0 - w) * curve[i] + w * curve[i + 1]


@dataclass(frozen=True, eq=False)
class CostTable:
    """One shape's measured verification step times on a B x k x ctx grid.

    Attributes:
        shape: the rows' ``model`` name.
        b: float64[nb] running requests of the grid, ascending.
        k: int64[nk] draft tokens per request of the grid, ascending, ``k[0] == 0``.
        ctx: float64[nc] context tokens per request of the grid, ascending.
        ms: float64[nb, nk, nc] step time (ms).
        source: the file it was read from.
    """

    shape: str
    b: np.ndarray
    k: np.ndarray
    ctx: np.ndarray
    ms: np.ndarray
    source: str = ""

    @property
    def q(self) -> np.ndarray:
        """float64[nk] query tokens per request of the grid (``1 + k``)."""
        return 1.0 + self.k.astype(np.float64)

    @property
    def k_max(self) -> int:
        """Longest draft of the grid (tokens)."""
        return int(self.k[-1])

    def curve(self, n: float, ctx: float) -> np.ndarray:
        """float64[nk]: step time (ms) at each k of the grid for ``n`` running requests of ``ctx`` context tokens
        each (interpolated in B and ctx, clamped to the grid)."""
        out = np.empty(self.k.shape[0])
        curve_into(self.b, self.ctx, self.ms, float(n), float(ctx), out)
        return out

    def step_ms(self, n: float, query_tokens: float, ctx: float) -> float:
        """Time (ms) of a verification step of ``n`` running requests sending ``query_tokens`` query tokens in all
        (``n`` + every draft token) with ``ctx`` context tokens per request."""
        if n <= 0:
            return 0.0
        return float(price(self.q, self.curve(n, ctx), float(query_tokens) / float(n)))

    def ratio_to_k0(self, n: float, query_tokens: float, ctx: float) -> float:
        """``step_ms`` over the time of the same step without drafting (``query_tokens = n``)."""
        c = self.curve(n, ctx)
        return float(price(self.q, c, float(query_tokens) / float(n)) / c[0])


def parse_spec(spec: str) -> tuple[str, str | None]:
    """``FILE`` or ``FILE@SHAPE`` -> (file, shape or None). A spec naming an existing file is that file whole."""
    if Path(spec).is_file() or "@" not in spec:
        return spec, None
    path, shape = spec.rsplit("@", 1)
    return path, shape or None


def _number(row: dict, key: str, where: str, integer: bool, low: float) -> float:
    v = row.get(key)
    ok = isinstance(v, int) if integer else isinstance(v, (int, float))
    if not ok or isinstance(v, bool) or not math.isfinite(v) or v < low:
        kind = "an integer" if integer else "a number"
        raise CostTableError(f"{where}: '{key}' must be {kind} >= {low:g}, got {v!r}")
    return float(v)


def tables_from_rows(rows: object, source: str = "") -> dict[str, CostTable]:
    """Every shape's table from the ``rows`` of a cost-table file (validated; :class:`CostTableError`)."""
    head = f"cost table {source}" if source else "cost table"
    if not isinstance(rows, list) or not rows:
        raise CostTableError(f"{head}: 'rows' must be a non-empty list")
    cells: dict[str, dict[tuple[int, int, int], tuple[float, float | None]]] = {}
    for i, row in enumerate(rows):
        where = f"{head}: rows[{i}]"
        if not isinstance(row, dict):
            raise CostTableError(f"{where}: expected an object, got {type(row).__name__}")
        shape = row.get("model")
        if not isinstance(shape, str) or not shape:
            raise CostTableError(f"{where}: 'model' (the shape) must be a non-empty string, got {shape!r}")
        b = int(_number(row, "B", where, True, 1))
        k = int(_number(row, "k", where, True, 0))
        c = int(_number(row, "ctx", where, True, 1))
        ms = _number(row, "step_ms", where, False, 0)
        if ms <= 0:
            raise CostTableError(f"{where}: 'step_ms' must be > 0, got {ms!r}")
        ratio = _number(row, "ratio_to_k0", where, False, 0) if row.get("ratio_to_k0") is not None else None
        grid = cells.setdefault(shape, {})
        if (b, k, c) in grid:
            raise CostTableError(f"{where}: second row for {shape} B={b} k={k} ctx={c}")
        grid[(b, k, c)] = (ms, ratio)
    out = {}
    for shape, grid in cells.items():
        bs, ks, cs = (sorted({key[a] for key in grid}) for a in range(3))
        if ks[0] != 0 or len(ks) < 2:
            raise CostTableError(f"{head}: {shape} needs rows at k = 0 and at least one k > 0, has k {ks}")
        ms = np.empty((len(bs), len(ks), len(cs)))
        for ib, b in enumerate(bs):
            for ik, k in enumerate(ks):
                for ic, c in enumerate(cs):
                    if (b, k, c) not in grid:
                        raise CostTableError(f"{head}: {shape} is not a full grid of B {bs} x k {ks} x ctx {cs}: "
                                             f"no row for B={b} k={k} ctx={c}")
                    ms[ib, ik, ic], ratio = grid[(b, k, c)]
                    base = grid[(b, 0, c)][0]
                    if ratio is not None and abs(ratio - ms[ib, ik, ic] / base) > RATIO_TOLERANCE * ratio:
                        raise CostTableError(f"{head}: {shape} B={b} k={k} ctx={c}: ratio_to_k0 {ratio:g} is not "
                                             f"step_ms / step_ms(k=0) = {ms[ib, ik, ic] / base:.4g}")
        out[shape] = CostTable(shape, np.asarray(bs, np.float64), np.asarray(ks, np.int64),
                               np.asarray(cs, np.float64), ms, source)
    return out


def load_cost_tables(path: str | Path) -> dict[str, CostTable]:
    """Every shape's table of a cost-table file, by shape name (:class:`CostTableError` on any problem)."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise CostTableError(f"cost table {path}: cannot read it ({exc.strerror or exc})") from None
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise CostTableError(f"cost table {path}: not JSON ({exc})") from None
    if not isinstance(data, dict) or "rows" not in data:
        raise CostTableError(f"cost table {path}: expected a JSON object with 'rows'")
    return tables_from_rows(data["rows"], str(path))


def load_cost_table(spec: str) -> CostTable:
    """The table a spec names (``FILE`` holding one shape, or ``FILE@SHAPE``); :class:`CostTableError` otherwise."""
    path, shape = parse_spec(spec)
    tables = load_cost_tables(path)
    if shape is None:
        if len(tables) > 1:
            raise CostTableError(f"cost table {path}: holds {len(tables)} shapes ({', '.join(tables)}); name one as "
                                 f"FILE@SHAPE")
        return next(iter(tables.values()))
    if shape not in tables:
        raise CostTableError(f"cost table {path}: no shape {shape!r} (it holds {', '.join(tables)})")
    return tables[shape]
