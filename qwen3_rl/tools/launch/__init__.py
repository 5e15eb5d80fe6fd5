"""Launch helpers: reading train scripts into their verl command (``train_script``)."""

from qwen3_rl.tools.launch.train_script import TrainCommand, TrainScriptError, parse_train_script

__all__ = ["TrainCommand", "TrainScriptError", "parse_train_script"]
