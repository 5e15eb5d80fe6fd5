"""``python -m qwen3_rl eval merge|score|compare``: see :mod:`qwen3_rl.tools.eval`."""

from __future__ import annotations

import sys
from collections.abc import Sequence

USAGE = (
    "usage: python -m qwen3_rl eval <merge|score|compare> [args]\n\n"
    "  merge    verl Megatron checkpoint (global_step_N/actor) -> HF directory, through verl.model_merger\n"
    "  score    accuracy on aime2024 / gsm8k test with vLLM (offline or --server), mean ± std over --rounds\n"
    "  compare  before vs after table (--plot PNG) beside ref 004's 38.99 -> 45.33\n"
)


def main(argv: Sequence[str] | None = None) -> int:
    """Dispatch to the sub-command; 2 on usage errors."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if args else 2
    cmd, rest = args[0], args[1:]
    if cmd == "merge":
        from qwen3_rl.tools.eval.merge import main as merge_main

        return merge_main(rest)
    if cmd == "score":
        from qwen3_rl.tools.eval.score import main as score_main

        return score_main(rest)
    if cmd == "compare":
        from qwen3_rl.tools.eval.compare import main as compare_main

        return compare_main(rest)
    print(f"error: unknown eval command '{cmd}'\n\n{USAGE}", file=sys.stderr)
    return 2
