"""Model-free speculative-decoding drafters (suffix automaton, per request or group-aware)."""

from qwen3_rl.spec_decode.base import DraftProposer
from qwen3_rl.spec_decode.sam import SamConfig, SamProposer, group_key

__all__ = ["DraftProposer", "SamConfig", "SamProposer", "group_key"]
