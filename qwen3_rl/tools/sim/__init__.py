"""Tooling, not runtime: the rollout simulator and its length models (``python -m qwen3_rl simulate ...``).

* :mod:`qwen3_rl.tools.sim.lengths` -- rollout length files: format, reader, and a generator shaped on the
  figures of [ref 002 §1.3] (docs/references.md);
* :mod:`qwen3_rl.tools.sim.simulate` -- event-driven rollout simulator (data / rollout rebalancing policies,
  KV transfer, drafting), its step-time model and fit, plot and CLI;
* :mod:`qwen3_rl.tools.sim.drafting` -- SAM verification steps with per-step k, history coverage by placement;
* :mod:`qwen3_rl.tools.sim.server` -- server-mode placements (verl's spread, group routing) with the product's routers;
* :mod:`qwen3_rl.tools.sim.step_table` -- verification cost from a measured step table (interpolated ratios);
* :mod:`qwen3_rl.tools.sim.fully_async` -- verl's fully-async trainer: Rollouter and Trainer on separate dies,
  priced per trained sample against the synchronous step.

Nothing in the training or rollout runtime imports this package; it imports the runtime's balancing
logic (:mod:`qwen3_rl.rollout.data_rebalance`, :mod:`qwen3_rl.rollout.rebalance`,
:mod:`qwen3_rl.rollout.server_routing`) to simulate it.
"""
