# shellcheck shell=bash
# EPLB for the rollout (docs/eplb.md), shared by the 235B (MoE) train scripts: vLLM-Ascend dynamic EPLB
# with our packing-aware placement (eplb_policy_type 4, vllm_ascend patch 0004). Sourced after the
# script's ROLLOUT_DP and ROLLOUT_TP. With EP over all dies each die holds one of the 128 experts, so EPLB
# needs redundant slots, a multiple of the EP size (vLLM-Ascend splits experts + redundant evenly over
# the EP ranks); default: one redundant slot per die.
[[ "${BASH_SOURCE[0]}" != "$0" ]] || { echo "${BASH_SOURCE[0]}: source it from a train script" >&2; exit 2; }

ROLLOUT_EPLB=${ROLLOUT_EPLB:-False}
ROLLOUT_EPLB_REDUNDANT_EXPERTS=${ROLLOUT_EPLB_REDUNDANT_EXPERTS:-$((ROLLOUT_DP * ROLLOUT_TP))}
ROLLOUT_EPLB_HEAT_INTERVAL=${ROLLOUT_EPLB_HEAT_INTERVAL:-400}
ROLLOUT_EPLB_ALGO_INTERVAL=${ROLLOUT_EPLB_ALGO_INTERVAL:-30}

# train_add_eplb_overrides: the eplb_config keys and DYNAMIC_EPLB for the Ray workers when ROLLOUT_EPLB
# is True (also true / 1); nothing when False; any other value stops the script.
train_add_eplb_overrides() {
    case "${ROLLOUT_EPLB}" in
        True | true | 1)
            # keys read by vllm_ascend/ascend_config.py (refresh_eplb_config); vLLM-Ascend refuses dynamic_eplb
            # unless its env var DYNAMIC_EPLB is "true" (eplb_utils.py check_dynamic_eplb): set for every Ray worker
            overrides+=(
                "+actor_rollout_ref.rollout.engine_kwargs.vllm.additional_config.eplb_config.dynamic_eplb=True"
                "+actor_rollout_ref.rollout.engine_kwargs.vllm.additional_config.eplb_config.eplb_policy_type=4"
                "+actor_rollout_ref.rollout.engine_kwargs.vllm.additional_config.eplb_config.num_redundant_experts=${ROLLOUT_EPLB_REDUNDANT_EXPERTS}"
                "+actor_rollout_ref.rollout.engine_kwargs.vllm.additional_config.eplb_config.expert_heat_collection_interval=${ROLLOUT_EPLB_HEAT_INTERVAL}"
                "+actor_rollout_ref.rollout.engine_kwargs.vllm.additional_config.eplb_config.algorithm_execution_interval=${ROLLOUT_EPLB_ALGO_INTERVAL}"
                "+ray_kwargs.ray_init.runtime_env.env_vars.DYNAMIC_EPLB='true'"
            )
            ;;
        False | false | 0) ;;
        *)
            echo "ROLLOUT_EPLB must be True or False, got '${ROLLOUT_EPLB}'" >&2
            exit 2
            ;;
    esac
}
