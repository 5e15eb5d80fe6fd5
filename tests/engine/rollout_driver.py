"""verl 0.6.1's sync SPMD rollout (``vLLMRollout``, patched) on vLLM 0.13.0's real CPU engine, with the
rollout config composed by Hydra from a real train script; prints one JSON line.

    python tests/engine/rollout_driver.py SPEC.json

SPEC: {"workspace": DIR, "script": "internal/train_....sh", "env": {VAR: value},
       "overrides": [Hydra overrides appended to the script's, as a user would pass them],
       "prompts": [[token ids], ...], "n": samples per prompt, "do_sample": [bool or "validate", ...] (one
       generate_sequences call each, in order; "validate": do_sample with meta_info validate=True, the trainer's
       validation call, sampled with rollout.val_kwargs), "port": a free TCP port for the gloo world of 1,
       "ascend": optional bool (vLLM-Ascend's NPUWorker/NPUModelRunner on the CPU stand-in)}
Result: {"rollout": the resolved rollout config's spec-decode keys, "logprobs": the requests'
SamplingParams.logprobs, "generations": [{"do_sample", "validate", "responses": [[ids]], "metrics": vLLM's
spec-decode counters accrued by that call, "meta_info": the returned DataProto's meta_info (verl 0013:
the rollout's own counts), "step_metrics": what the trainer logs from it}], "drafter": class}.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE))

import workspace  # noqa: E402


def compose_config(spec: dict):
    """The train script's verl command (run by bash with the spec's env), composed by Hydra against the
    patched verl's config, with the tiny-model overrides appended."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from qwen3_rl.tools.launch import parse_train_script

    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": os.environ.get("HOME", "/tmp"), **spec["env"]}
    cmd = parse_train_script(REPO / spec["script"], env=env, extra_args=spec["overrides"])
    verl_dir = Path(spec["workspace"]) / "verl" / "verl" / "trainer" / "config"
    config_dir = verl_dir if cmd.config_name == "ppo_megatron_trainer" else REPO / "qwen3_rl" / "trainer" / "config"
    with initialize_config_dir(config_dir=str(config_dir), version_base=None):
        cfg = compose(config_name=cmd.config_name, overrides=list(cmd.overrides))
    OmegaConf.resolve(cfg)
    return cfg


def main() -> int:
    spec = json.loads(Path(sys.argv[1]).read_text())
    ws = Path(spec["workspace"])
    ascend = bool(spec.get("ascend"))  # vLLM-Ascend's own engine on the CPU stand-in (qwen3_rl.cpu_device.npu)
    if ascend:
        os.environ["VLLM_PLUGINS"] = "ascend,qwen3_rl"
    workspace.activate(ws)
    if ascend:
        from qwen3_rl.cpu_device.npu import run as ascend_run

        ascend_run.prepare([str(ws / "vllm-ascend")])
    else:
        import shims

        shims.install_ascend_pytorch_rejection_sampler(ws / "vllm-ascend")
    import torch
    import torch.distributed as dist
    from omegaconf import OmegaConf
    from torch.distributed.device_mesh import init_device_mesh

    from engine_driver import counters, runner_of

    cfg = compose_config(spec)
    from verl import DataProto
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.config import HFModelConfig, RolloutConfig
    from verl.workers.rollout.vllm_rollout.vllm_rollout_spmd import vLLMRollout

    from qwen3_rl.spec_decode.metrics import step_metrics
    from qwen3_rl.trainer.seam import RecipeConfig, pop_rollout_counts

    rollout_cfg = omega_conf_to_dataclass(cfg.actor_rollout_ref.rollout, dataclass_type=RolloutConfig)
    model_cfg = omega_conf_to_dataclass(cfg.actor_rollout_ref.model, dataclass_type=HFModelConfig)
    # the environment torchrun / verl's Ray workers give each rank (vLLM's external launcher reads it)
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(spec["port"]), "RANK": "0", "LOCAL_RANK": "0",
                       "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"})
    dist.init_process_group("gloo", rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "infer_tp"))
    rollout = vLLMRollout(rollout_cfg, model_cfg, mesh)

    tok = model_cfg.tokenizer
    prompts = [p for p in spec["prompts"] for _ in range(spec.get("n", 1))]  # verl repeats before the rollout
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), tok.pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    pos = torch.clamp(mask.cumsum(-1) - 1, min=0)
    llm = rollout.inference_engine
    generations = []
    for call in spec["do_sample"]:
        do_sample, validate = call is True or call == "validate", call == "validate"
        data = DataProto.from_dict({"input_ids": ids, "attention_mask": mask, "position_ids": pos},
                                   meta_info={"eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id,
                                              "do_sample": do_sample, "validate": validate})
        before = counters(llm)
        out = rollout.generate_sequences(data)
        after = counters(llm)
        lp = out.batch["rollout_log_probs"].tolist() if "rollout_log_probs" in out.batch.keys() else None
        generations.append({"do_sample": do_sample, "validate": validate, "responses": out.batch["responses"].tolist(),
                            "rollout_log_probs": lp,
                            "metrics": {k: after[k] - before.get(k, 0.0) for k in after},
                            "meta_info": dict(out.meta_info),
                            # what the seam's trainer hook makes of it (one worker here)
                            "step_metrics": step_metrics(pop_rollout_counts(
                                {"metrics": dict(out.meta_info.get("metrics", {}))}))})
    spec_cfg = cfg.actor_rollout_ref.rollout.engine_kwargs.vllm.get("speculative_config")
    result = {"rollout": {"speculative_config": OmegaConf.to_container(spec_cfg) if spec_cfg else None,
                          "calculate_log_probs": rollout_cfg.calculate_log_probs,
                          "disable_log_stats": rollout_cfg.disable_log_stats,
                          "val_temperature": rollout_cfg.val_kwargs.temperature,
                          "data_rebalance": RecipeConfig.from_group(cfg.qwen3_rl).data_rebalance.enable},
              "logprobs": rollout.sampling_params.logprobs, "generations": generations,
              "drafter": type(getattr(runner_of(llm), "drafter", None)).__name__}
    print("ENGINE_RESULT " + json.dumps(result))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
