"""Answer verification for the math setups, loaded by verl as ``custom_reward_function``.

verl loads this file by path (``custom_reward_function.path``) into a module named ``custom_module``,
so it imports nothing from ``qwen3_rl``: only the standard library and ``math_verify``.

Rule: take the response's FINAL marked answer -- the last ``\\boxed{...}`` / ``\\fbox{...}``, else the
last ``Answer: ...`` line (DAPO-Math / AIME prompt format), else the last ``#### ...`` (GSM8K) -- and
compare it with the ground truth by math-verify (symbolic / numeric equivalence). A response without a
marked answer scores as wrong: never a search for the right number anywhere in the text (a 32K-token
chain of thought contains every small number).
"""

from __future__ import annotations

import re
import threading
from typing import Any

_BOX_CMDS = ("\\boxed", "\\fbox")
_ANSWER_RE = re.compile(r"(?im)^[^\S\n]*\**answer\**[^\S\n]*[:：][^\S\n]*(.+?)[^\S\n]*$")
_GSM8K_RE = re.compile(r"####[^\S\n]*([^\n]+)")


def _last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` / ``\\fbox{...}`` with balanced braces (or ``\\boxed x``)."""
    best_pos, best = -1, None
    for cmd in _BOX_CMDS:
        pos = text.rfind(cmd)
        while pos != -1:
            i = pos + len(cmd)
            if i < len(text) and text[i] == "{":
                depth, j = 0, i
                while j < len(text):
                    if text[j] == "{":
                        depth += 1
                    elif text[j] == "}":
                        depth -= 1
                        if depth == 0:
                            break
                    j += 1
                if depth == 0:
                    if pos > best_pos:
                        best_pos, best = pos, text[i + 1 : j]
                    break
            elif i < len(text) and text[i] == " ":  # "\boxed 5"
                m = re.match(r" +([^\s$]+)", text[i:])
                if m and pos > best_pos:
                    best_pos, best = pos, m.group(1)
                break
            pos = text.rfind(cmd, 0, pos)
    return best


def extract_final_answer(text: str) -> str | None:
    """The final marked answer of a response, or None when it marks none.

    Args:
        text: decoded response (any length).

    Returns:
        the answer string (stripped), or None.
    """
    boxed = _last_boxed(text)
    if boxed is not None and boxed.strip():
        return boxed.strip()
    answers = _ANSWER_RE.findall(text)
    if answers:
        ans = answers[-1].strip().rstrip(".").strip()
        inner = _last_boxed(ans)
        ans = inner.strip() if inner else ans.strip("$ ")
        return ans or None
    gsm = _GSM8K_RE.findall(text)
    if gsm:
        return gsm[-1].strip().rstrip(".") or None
    return None


def _normalize_plain(s: str) -> str:
    s = s.strip().strip("$").strip()
    s = re.sub(r"\\text\{([^}]*)\}", r"\1", s)
    s = s.replace("\\!", "").replace("\\,", "").replace("\\ ", "").replace(" ", "")
    s = s.replace("\\left", "").replace("\\right", "").replace("dfrac", "frac").replace("tfrac", "frac")
    s = s.rstrip(".")
    if re.fullmatch(r"-?[\d,]+(\.\d+)?", s) and "," in s:
        s = s.replace(",", "")
    return s


def answers_match(pred: str, ground_truth: str) -> bool:
    """True when ``pred`` and ``ground_truth`` are the same answer (math-verify, then exact normal form)."""
    if _normalize_plain(pred) == _normalize_plain(ground_truth):
        return True
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    main = threading.current_thread() is threading.main_thread()
    tmo = 5 if main else None  # math-verify's timeout uses SIGALRM: main thread only
    configs = [LatexExtractionConfig(), ExprExtractionConfig()]
    try:
        gold = parse(f"${ground_truth}$", extraction_config=configs, parsing_timeout=tmo)
        target = parse(f"${pred}$", extraction_config=configs, parsing_timeout=tmo)
        if not gold or not target:
            return False
        return bool(verify(gold, target, timeout_seconds=tmo))
    except Exception:  # noqa: BLE001 - a malformed answer is a wrong answer, never a crash of the trainer
        return False


def compute_score(
    data_source: str,
    solution_str: str,
    ground_truth: str,
    extra_info: dict[str, Any] | None = None,
    correct_score: float = 1.0,
    incorrect_score: float = 0.0,
    **_: Any,
) -> dict[str, Any]:
    """verl ``custom_reward_function`` entry.

    Args:
        data_source: dataset name (all math sources are scored the same way).
        solution_str: decoded response.
        ground_truth: reference answer (``reward_model.ground_truth``).
        extra_info: unused.
        correct_score / incorrect_score: reward values (DAPO uses +1 / -1, set through
            ``custom_reward_function.reward_kwargs``).

    Returns:
        ``{"score": float, "acc": bool, "pred": str}`` (verl logs ``acc``; DAPO filters on it).
    """
    gt = str(ground_truth)
    gsm = _GSM8K_RE.findall(gt)
    if gsm:  # a raw GSM8K solution given as ground truth
        gt = gsm[-1]
    pred = extract_final_answer(solution_str)
    ok = pred is not None and answers_match(pred, gt)
    return {"score": float(correct_score if ok else incorrect_score), "acc": bool(ok), "pred": pred or ""}
