"""``python -m qwen3_rl <command> ...``: the recipe's commands."""

from __future__ import annotations

import sys


def _usage() -> str:
    return (
        "usage: python -m qwen3_rl <command> [args]\n\n"
        "commands:\n"
        "  download   fetch pinned upstream source trees (download_frameworks_source_code.sh)\n"
        "  patches    apply / check / status / revert / lint the patch series (apply_all_patches.sh)\n"
        "  build      install the patched stack in order (build_project.sh)\n"
        "  pins       print pinned frameworks (--format table|shell|json)\n"
        "  features   the feature registry (features.toml): features overrides --setup SCRIPT | features list\n"
        "  readme     regenerate / check README.md's generated tables (--write | --check)\n"
        "  data       convert a downloaded dataset to verl parquet (data prepare --dataset NAME ...)\n"
        "  simulate   rollout load-balancing simulator (rollout | gen-lengths | fit-step-model)\n"
        "  plan       per-die memory plan of a rollout/actor layout (weights, KV, concurrency)\n"
        "  report     table, plots and published-figure comparison of a verl training log\n"
        "  preflight  check a train script, the node and the files before launching (preflight TRAIN_SCRIPT)\n"
        "  launch     steps of ray_start_npu.sh (resolve, show, wait-cluster, cpu-bind, ...)\n"
        "  eval       after training: merge a checkpoint to HF, score AIME/gsm8k accuracy, compare before/after\n"
        "  tiny-model tiny random-weight Qwen3 / Qwen3-MoE with a local tokenizer (tiny-model --out DIR [--moe])\n"
        "  tiny-data  generated gsm8k-style problems as verl parquet for the tiny CPU run (tiny-data --out DIR)\n"
        "  tiny-sft   short seeded supervised warm-up of the tiny model (the answer format) before GRPO\n"
        "  cpu-setup  everything the tiny CPU run needs: patched trees, tiny models, data, warm-up (setup_cpu.sh)\n"
        "  cpu-env    the CPU profile's environment for ray_start_npu.sh --device cpu (or the set-up command)\n"
        "  sam-warm-cache  compile every SAM drafter kernel into numba's disk cache (run at image build)\n"
    )


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    if cmd == "download":
        from qwen3_rl.upstream.cli import download_main

        return download_main(rest)
    if cmd == "patches":
        from qwen3_rl.upstream.cli import patches_main

        return patches_main(rest)
    if cmd == "build":
        from qwen3_rl.upstream.build import build_main

        return build_main(rest)
    if cmd == "plan":
        from qwen3_rl.plan.cli import main as plan_main

        return plan_main(rest)
    if cmd == "report":
        from qwen3_rl.report.cli import main as report_main

        return report_main(rest)
    if cmd == "features":
        from qwen3_rl.features import main as features_main

        return features_main(rest)
    if cmd == "sam-warm-cache":
        from qwen3_rl.spec_decode.runner_drafter import warm_cache_main

        return warm_cache_main(rest)
    if cmd == "readme":
        from qwen3_rl.readme import main as readme_main

        return readme_main(rest)
    if cmd == "pins":
        from qwen3_rl.pins import pins_main

        return pins_main(rest)
    if cmd == "simulate":
        from qwen3_rl.sim.simulate import main as simulate_main

        return simulate_main(rest)
    if cmd == "data":
        from qwen3_rl.data.prepare import main as data_main

        return data_main(rest)
    if cmd == "preflight":
        from qwen3_rl.launch.preflight import main as preflight_main

        return preflight_main(rest)
    if cmd == "launch":
        from qwen3_rl.launch.cli import main as launch_main

        return launch_main(rest)
    if cmd == "eval":
        from qwen3_rl.eval.cli import main as eval_main

        return eval_main(rest)
    if cmd == "tiny-model":
        from qwen3_rl.tools.tiny_model import main as tiny_main

        return tiny_main(rest)
    if cmd == "tiny-data":
        from qwen3_rl.tools.tiny_data import main as tiny_data_main

        return tiny_data_main(rest)
    if cmd == "tiny-sft":
        from qwen3_rl.tools.tiny_sft import main as tiny_sft_main

        return tiny_sft_main(rest)
    if cmd in ("cpu-setup", "cpu-env"):
        from qwen3_rl.tools import cpu_setup

        return (cpu_setup.setup_main if cmd == "cpu-setup" else cpu_setup.env_main)(rest)
    print(f"error: unknown command '{cmd}'\n\n{_usage()}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
