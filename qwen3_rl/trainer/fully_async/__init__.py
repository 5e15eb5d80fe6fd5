"""Our fully-async GRPO/PPO trainer over verl 0.6.1's installed pieces (verl's own ``recipe/fully_async_policy``
is in neither its PyPI wheel nor its sdist).

Two pools: the trainer (verl's Megatron actor worker group, role ``actor`` (+ ``ref`` when the KL needs it), no
rollout) and the rollout (standalone vLLM servers started by verl's ``AgentLoopManager`` with no worker group).
Prompts stream from the dataloader to the agent loop one group (n samples) at a time; finished groups queue up
and the trainer takes ``require_batches`` x ``ppo_mini_batch_size`` of them per update; at most
(1 + ``staleness_threshold``) x the prompts of one weight version are generated per version. After every
``trigger_parameter_sync_step`` updates the trainer's weights go to the rollout workers over a stateless
collective group (gloo on CPU, HCCL on an NPU), the servers paused meanwhile; with ``partial_rollout`` the
running requests are aborted at the pause and resumed after it with their tokens so far.

* :mod:`.settings` -- the ``async_training`` group (validated) and the pool sizes;
* :mod:`.stream` -- the generation quota per weight version and the per-batch staleness / resume metrics (pure);
* :mod:`.weight_sync` -- the collective backend choice, the bucket plan, the stateless group, send / receive;
* :mod:`.agent_loop` -- the agent loop that resumes an aborted request with its tokens so far;
* :mod:`.rollout` -- the vLLM server / rollout worker / replica / agent-loop manager subclasses (pause, abort,
  resume, receive weights);
* :mod:`.workers` -- the trainer's Megatron actor worker (export and send weights);
* :mod:`.trainer` -- the driver loop (``RayPPOTrainer`` subclass) and the Hydra entry
  ``python -m qwen3_rl.trainer.fully_async``.

:mod:`.settings`, :mod:`.stream` and :mod:`.weight_sync` import neither verl nor vLLM at module import time.
"""
