"""Model-free speculative-decoding drafter: a suffix automaton per request or per prompt group (SAM)."""

from qwen3_rl.spec_decode.sam import SamConfig, SamProposer, group_key

__all__ = ["SamConfig", "SamProposer", "group_key"]
