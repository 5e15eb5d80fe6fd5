"""``python -m qwen3_rl <command> ...``: the recipe's commands, one table."""

from __future__ import annotations

import importlib
import sys
from typing import NamedTuple


class Command(NamedTuple):
    """One command: ``module:function`` taking the remaining argv and returning an exit code, and its help."""

    target: str
    help: str


COMMANDS: dict[str, Command] = {
    "download": Command("qwen3_rl.tools.upstream.cli:download_main",
                        "fetch pinned upstream source trees (download_frameworks_source_code.sh)"),
    "patches": Command("qwen3_rl.tools.upstream.cli:patches_main",
                       "apply / check / status / revert / lint the patch series (apply_all_patches.sh)"),
    "build": Command("qwen3_rl.tools.upstream.build:build_main", "install the patched stack in order (build_project.sh)"),
    "pins": Command("qwen3_rl.tools.pins:pins_main", "print pinned frameworks (--format table|shell|json)"),
    "features": Command("qwen3_rl.tools.features:main",
                        "the feature registry (features.toml): features overrides --setup SCRIPT | features list"),
    "readme": Command("qwen3_rl.tools.readme:main", "regenerate / check the generated tables (--write | --check)"),
    "data": Command("qwen3_rl.tools.data.prepare:main",
                    "convert a downloaded dataset to verl parquet (data prepare --dataset NAME ...)"),
    "simulate": Command("qwen3_rl.tools.sim.simulate:main",
                        "rollout load-balancing simulator (rollout | gen-lengths | fit-step-model)"),
    "plan": Command("qwen3_rl.tools.plan.cli:main", "per-die memory plan of a rollout/actor layout (weights, KV, concurrency)"),
    "report": Command("qwen3_rl.tools.report.cli:main", "table, plots and published-figure comparison of a verl training log"),
    "preflight": Command("qwen3_rl.tools.launch.preflight:main",
                         "check a train script, the node and the files before launching (preflight TRAIN_SCRIPT)"),
    "launch": Command("qwen3_rl.tools.launch.cli:main", "steps of ray_start_npu.sh (resolve, show, wait-cluster, cpu-bind, ...)"),
    "eval": Command("qwen3_rl.tools.eval.cli:main",
                    "after training: merge a checkpoint to HF, score AIME/gsm8k accuracy, compare before/after"),
    "tiny-model": Command("qwen3_rl.tools.tiny_model:main",
                          "tiny random-weight Qwen3 / Qwen3-MoE with a local tokenizer (tiny-model --out DIR [--moe])"),
    "tiny-data": Command("qwen3_rl.tools.tiny_data:main",
                         "generated gsm8k-style problems as verl parquet for the tiny CPU run (tiny-data --out DIR)"),
    "tiny-sft": Command("qwen3_rl.tools.tiny_sft:main",
                        "short seeded supervised warm-up of the tiny model (the answer format) before GRPO"),
    "cpu-setup": Command("qwen3_rl.tools.cpu_setup:setup_main",
                         "everything the tiny CPU run needs: patched trees, tiny models, data, warm-up (setup_cpu.sh)"),
    "cpu-env": Command("qwen3_rl.tools.cpu_setup:env_main",
                       "the CPU profile's environment for ray_start_npu.sh --device cpu (or the set-up command)"),
    "calibrate": Command("qwen3_rl.tools.calibrate:main",
                         "measure a setup's verification-cost table (SAM_COST_TABLE) with dummy weights"),
    "sam-warm-cache": Command("qwen3_rl.tools.sam_warm_cache:main",
                              "compile every SAM drafter kernel into numba's disk cache (run at image build)"),
}


def usage() -> str:
    """The command list, generated from :data:`COMMANDS`."""
    width = max(map(len, COMMANDS))
    rows = "\n".join(f"  {name:<{width}}  {c.help}" for name, c in COMMANDS.items())
    return f"usage: python -m qwen3_rl <command> [args]\n\ncommands:\n{rows}\n"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    if cmd not in COMMANDS:
        print(f"error: unknown command '{cmd}'\n\n{usage()}", file=sys.stderr)
        return 2
    module, func = COMMANDS[cmd].target.split(":")
    return getattr(importlib.import_module(module), func)(rest)


if __name__ == "__main__":
    sys.exit(main())
