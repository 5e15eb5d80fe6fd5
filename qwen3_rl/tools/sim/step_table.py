"""Verification-step cost from a measured table (``simulate rollout --step-table F --shape NAME``).

Table file (the schema of ``verify_cost.py``'s output, e.g. ``verify_cost_h100.json`` of the shared bench data):
a JSON object whose ``rows`` hold ``{"model": NAME, "B": rows, "k": draft tokens, "ctx": context tokens per
request, "step_ms": ms, "ratio_to_k0": step_ms / step_ms at k = 0 (same B, ctx)}``; the rows of one ``model``
(the shape) must fill the grid ``B x k x ctx`` and hold k = 0. ``ratio_to_k0`` is derived from ``step_ms`` where
a row lacks it.

The simulator keeps its fitted A3 decode step for k = 0 and takes only the table's *shape* of the drafting cost:
a verification step of ``bucket`` rows, ``k`` drafts and mean context ``ctx`` costs the fitted step times
:func:`interp_ratio` (``table``). Between grid points the ratio is piecewise linear in each of ``B``, ``k`` and
``ctx``; outside the grid it is clamped to the nearest edge (the table says nothing there).
"""

from __future__ import annotations

import bisect
import json
import math
from dataclasses import dataclass
from pathlib import Path


class StepTableError(ValueError):
    """A step table that cannot be read or does not fill its grid (one-line message)."""


@dataclass(frozen=True)
class StepTable:
    """``ratio[iB][ik][ic]`` = verification step at ``ks[ik]`` drafts / step at k = 0, for ``Bs[iB]`` rows and
    ``ctxs[ic]`` context tokens per request; axes strictly ascending, ``ks[0] == 0``."""

    shape: str
    Bs: tuple[float, ...]
    ks: tuple[float, ...]
    ctxs: tuple[float, ...]
    ratio: tuple[tuple[tuple[float, ...], ...], ...]


def _bracket(axis: tuple[float, ...], x: float) -> tuple[int, int, float]:
    """Indices ``(lo, hi)`` around ``x`` on ``axis`` and the weight of ``hi`` (clamped to the edges)."""
    if x <= axis[0]:
        return 0, 0, 0.0
    if x >= axis[-1]:
        n = len(axis) - 1
        return n, n, 0.0
    hi = bisect.bisect_right(axis, x)
    lo = hi - 1
    return lo, hi, (x - axis[lo]) / (axis[hi] - axis[lo])


def interp_ratio(table: StepTable, B: float, k: float, ctx: float) -> float:
    """Verification step / decode step (dimensionless) at ``B`` rows, ``k`` drafts, ``ctx`` tokens per request:
    trilinear in (B, k, ctx) between the table's grid points, clamped outside; exact at grid points."""
    bl, bh, bw = _bracket(table.Bs, B)
    kl, kh, kw = _bracket(table.ks, k)
    cl, ch, cw = _bracket(table.ctxs, ctx)
    out = 0.0
    for ib, wb in ((bl, 1.0 - bw), (bh, bw)):
        for ik, wk in ((kl, 1.0 - kw), (kh, kw)):
            for ic, wc in ((cl, 1.0 - cw), (ch, cw)):
                w = wb * wk * wc
                if w:
                    out += w * table.ratio[ib][ik][ic]
    return out


def _num(row: dict, key: str, where: str) -> float:
    v = row.get(key)
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        raise StepTableError(f"{where}: field {key!r} must be a finite number, got {v!r}")
    return float(v)


def table_from_rows(rows: list[dict], shape: str, source: str = "table") -> StepTable:
    """The grid of ``shape`` from table rows (see module docstring); :class:`StepTableError` if it is incomplete."""
    mine = [r for r in rows if isinstance(r, dict) and r.get("model") == shape]
    if not mine:
        shapes = sorted({str(r.get("model")) for r in rows if isinstance(r, dict)})
        raise StepTableError(f"{source}: no rows for shape {shape!r} (shapes: {', '.join(shapes) or 'none'})")
    cells: dict[tuple[float, float, float], tuple[float, float | None]] = {}
    for i, r in enumerate(mine):
        where = f"{source}: {shape} row {i}"
        key = (_num(r, "B", where), _num(r, "k", where), _num(r, "ctx", where))
        ms = _num(r, "step_ms", where)
        if ms <= 0 or key[0] < 1 or key[1] < 0 or key[2] < 1:
            raise StepTableError(f"{where}: need step_ms > 0, B >= 1, k >= 0, ctx >= 1")
        ratio = _num(r, "ratio_to_k0", where) if "ratio_to_k0" in r else None
        if ratio is not None and ratio <= 0:
            raise StepTableError(f"{where}: ratio_to_k0 must be > 0")
        if key in cells:
            raise StepTableError(f"{source}: {shape} has two rows for B={key[0]:g} k={key[1]:g} ctx={key[2]:g}")
        cells[key] = (ms, ratio)
    Bs, ks, cs = (tuple(sorted({key[j] for key in cells})) for j in range(3))
    if ks[0] != 0:
        raise StepTableError(f"{source}: {shape} has no k = 0 rows (the ratios are relative to k = 0)")
    missing = [(b, k, c) for b in Bs for k in ks for c in cs if (b, k, c) not in cells]
    if missing:
        b, k, c = missing[0]
        raise StepTableError(f"{source}: {shape} does not fill its grid B x k x ctx ({len(missing)} cells missing, "
                             f"e.g. B={b:g} k={k:g} ctx={c:g})")
    ratio = tuple(tuple(tuple(
        cells[(b, k, c)][1] if cells[(b, k, c)][1] is not None else cells[(b, k, c)][0] / cells[(b, 0.0, c)][0]
        for c in cs) for k in ks) for b in Bs)
    return StepTable(shape, Bs, ks, cs, ratio)


def load_step_table(path: str | Path, shape: str) -> StepTable:
    """Read ``path`` (JSON object with ``rows``) and build the grid of ``shape``; one-line errors."""
    p = Path(path)
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise StepTableError(f"step table not found: {p}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise StepTableError(f"{p}: not a JSON step table ({type(e).__name__})") from None
    rows = data.get("rows") if isinstance(data, dict) else None
    if not isinstance(rows, list) or not rows:
        raise StepTableError(f"{p}: no 'rows' list")
    return table_from_rows(rows, shape, str(p))
