"""The fully-async driver: a ``RayPPOTrainer`` subclass (built on our DAPO trainer class, whose per-batch update
steps it reuses: old log-probs, ref, advantage, actor update) whose workers are two pools and whose ``fit`` streams.

The loop (one driver thread; the actor update runs in a second thread so that the rollout keeps being fed):

1. start prompts (one group of n samples each, on the agent-loop workers, round robin) while the weight version's
   counter is below (1 + staleness) x the prompts of one version (verl's count, :class:`.stream.PromptStream`: it
   restarts at each sync from the prompts not yet trained; staleness 0: one version's prompts, then nothing starts
   until the sync);
2. collect finished groups, score them (verl's reward manager; the agent loop already scored each sample) and
   queue them;
3. when ``require_batches`` x ``ppo_mini_batch_size`` groups are finished and the trainer is idle, train on them,
   oldest start version first, never past a running prompt of an older version (staleness of each sample = trainer
   version - the version that started it, at most ``ceil(staleness)``);
4. after every ``trigger_parameter_sync_step`` updates: pause the servers (abort running requests with
   ``partial_rollout``), broadcast the trainer's export to the rollout workers, check the checksums, resume
   under the new version (the aborted requests continue with their tokens so far);
5. after every ``trainer.save_freq`` updates and the last: verl's ``_save_checkpoint`` (actor, dataloader position)
   plus the prompts taken and not trained (:mod:`.checkpoint`). ``trainer.resume_mode`` (auto / resume_path):
   verl's ``_load_checkpoint`` before the loop, then a weight sync of the loaded weights before any generation;
   the carried prompts start first, the step and the weight version continue from the checkpoint.
"""

from __future__ import annotations

import time
import uuid
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from pprint import pprint
from typing import Any

import numpy as np

from qwen3_rl.trainer.fully_async.checkpoint import (
    STATE_FILE,
    StreamState,
    checkpoint_version,
    load_stream,
    resume_folder,
    save_stream,
    step_folder,
    untrained_prompts,
)
from qwen3_rl.trainer.fully_async.settings import AsyncSettings
from qwen3_rl.trainer.fully_async.stream import PromptStream, resume_metrics, staleness_metrics, version_quota


def spec_decode_since(hooks: Any, server_handles: list[Any], state: Any) -> tuple[dict[str, float], Any]:
    """The servers' spec-decode counters since ``state`` (the previous call's second value; None the first time)
    as ``rollout/spec_decode/*`` metrics, and the state for the next call (``({}, None)`` with no drafter or its
    metrics off). ``hooks``: the rollout's :class:`~qwen3_rl.trainer.seam.ServerHooks` or None."""
    if hooks is None:
        return {}, None
    from qwen3_rl.spec_decode.metrics import META_KEY, step_metrics

    counts: dict[str, int] = {}
    if state is not None:
        prefix = META_KEY + "/"
        for key, value in hooks.after_generate(server_handles, state, []).items():
            if str(key).startswith(prefix):
                counts[key[len(prefix):]] = int(sum(value)) if isinstance(value, list | tuple) else int(value)
    return step_metrics(counts), hooks.before_generate(server_handles)


def rollout_pool_config(config: Any) -> Any:
    """A copy of ``config`` whose ``trainer.{nnodes,n_gpus_per_node}`` are the rollout pool's (verl's standalone
    rollout sizes its servers from them, ``AgentLoopManager._initialize_llm_servers``)."""
    from omegaconf import OmegaConf, open_dict

    cfg = OmegaConf.create(OmegaConf.to_container(config, resolve=True))
    with open_dict(cfg):
        cfg.trainer.nnodes = int(config.rollout.nnodes)
        cfg.trainer.n_gpus_per_node = int(config.rollout.n_gpus_per_node)
    return cfg


def make_fully_async_trainer_class():
    """Build ``FullyAsyncTrainer`` (verl imported at call time)."""
    import ray
    from verl import DataProto
    from verl.single_controller.ray import RayClassWithInitArgs, RayWorkerGroup
    from verl.single_controller.ray.base import create_colocated_worker_cls
    from verl.trainer.ppo.metric_utils import compute_data_metrics, compute_timing_metrics
    from verl.trainer.ppo.ray_trainer import ResourcePoolManager
    from verl.utils.debug import marked_timer
    from verl.utils.tracking import Tracking

    from qwen3_rl.trainer.dapo import attach_rewards, make_dapo_trainer_class
    from qwen3_rl.trainer.fully_async.agent_loop import AGENT_NAME
    from qwen3_rl.trainer.fully_async.rollout import PartialAgentLoopManager
    from qwen3_rl.trainer.fully_async.weight_sync import gather_sync, plan_buckets
    from qwen3_rl.trainer.fully_async.workers import TrainerWorker

    base = make_dapo_trainer_class()

    class FullyAsyncTrainer(base):  # type: ignore[misc, valid-type]
        """Trainer pool + rollout pool, streamed samples, bounded staleness, partial rollout."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.fa = AsyncSettings.from_config(self.config)

        # ---- workers ------------------------------------------------------------------------------
        def init_workers(self) -> None:
            cfg = self.config
            pool_mgr = ResourcePoolManager(
                resource_pool_spec={"trainer_pool": [self.fa.trainer_procs] * self.fa.trainer_nnodes}, mapping={})
            pool_mgr.create_resource_pool()
            pool = pool_mgr.resource_pool_dict["trainer_pool"]
            cls = ray.remote(TrainerWorker)
            class_dict = {"actor": RayClassWithInitArgs(cls=cls, config=cfg.actor_rollout_ref, role="actor")}
            if self.use_reference_policy:
                class_dict["ref"] = RayClassWithInitArgs(cls=cls, config=cfg.actor_rollout_ref, role="ref")
            wg = RayWorkerGroup(resource_pool=pool, ray_cls_with_init=create_colocated_worker_cls(class_dict),
                                device_name=self.device_name)
            spawned = wg.spawn(prefix_set=class_dict.keys())
            if self.use_reference_policy:
                self.ref_policy_wg = spawned["ref"]
                self.ref_policy_wg.init_model()
            self.actor_rollout_wg = spawned["actor"]
            self.actor_rollout_wg.init_model()
            self.rm_wg = None
            self.resource_pool_manager = pool_mgr
            # the rollout pool: standalone servers (verl's agent loop), validation goes through it too
            self.async_rollout_mode = True
            self.async_rollout_manager = PartialAgentLoopManager(rollout_pool_config(cfg))
            self._init_weight_sync()

        def _init_weight_sync(self) -> None:
            """The stateless group: trainer rank 0 (root) + every rollout worker; the export's plan."""
            import torch

            workers = self.async_rollout_manager.workers
            world = 1 + len(workers)
            # the trainer's rank 0 (it holds the weights and sees its device) says where they live
            device = next(d for d in self.actor_rollout_wg.qwen3_rl_sync_device() if d is not None)
            backend = weight_sync_backend(device)
            host, port = next(a for a in self.actor_rollout_wg.qwen3_rl_sync_address() if a is not None)
            refs = self.actor_rollout_wg.qwen3_rl_join_group(host, port, world, backend)
            refs = list(refs) + [w.qwen3_rl_join_group.remote(host, port, 1 + i, world, backend)
                                 for i, w in enumerate(workers)]
            ray.get(refs)
            self.sync_specs = self.actor_rollout_wg.qwen3_rl_export_specs()[0]
            sizes = {s.dtype: torch.empty(0, dtype=getattr(torch, s.dtype)).element_size() for s in self.sync_specs}
            self.sync_buckets = plan_buckets(self.sync_specs, sizes)
            print(f"fully async: weight sync over {backend}, {world} ranks (trainer rank 0 + {len(workers)} rollout "
                  f"workers), {len(self.sync_specs)} tensors in {len(self.sync_buckets)} buckets")

        def sync_weights(self, version: int) -> dict[str, float]:
            """Pause the rollout, broadcast the trainer's weights, check them, resume under ``version``."""
            t0 = time.perf_counter()
            aborted = self.async_rollout_manager.pause(abort=self.fa.partial_rollout)
            t1 = time.perf_counter()
            send = self.actor_rollout_wg.qwen3_rl_send_weights(self.sync_specs, self.sync_buckets)
            recv = [w.qwen3_rl_receive.remote(self.sync_specs, self.sync_buckets)
                    for w in self.async_rollout_manager.workers]
            sends, got = gather_sync(list(send), recv)  # a dead rollout worker stops the wait at once
            sent = sends[0]
            bad = [(self.sync_specs[i].name, sent[i], g[i]) for g in got for i in range(len(sent)) if g[i] != sent[i]]
            if bad:
                raise RuntimeError(f"weight sync: {len(bad)} tensor(s) arrived different, e.g. {bad[:3]}")
            t2 = time.perf_counter()
            self.async_rollout_manager.resume(version)
            return {"fully_async/sync/aborted_requests": float(aborted), "fully_async/sync/tensors": float(len(sent)),
                    "timing_s/fully_async/pause": t1 - t0, "timing_s/fully_async/weight_sync": t2 - t1,
                    "fully_async/param_version": float(version)}

        # ---- the prompt stream --------------------------------------------------------------------
        def _prompts(self, carried: list[Any], start_epoch: int):
            """Single prompts (DataProto of one row): ``carried`` (from a checkpoint) first, then the dataloader's
            in order, epoch after epoch from ``start_epoch``. ``self._pending``: the rows of the current batch not
            yet handed out; ``self._epoch``: the epoch being read (both saved by :meth:`_save_stream`)."""
            self._epoch = start_epoch
            self._pending = deque(carried)
            while self._pending:
                yield self._pending.popleft()
            for epoch in range(start_epoch, self.config.trainer.total_epochs):
                self._epoch = epoch
                for batch_dict in self.train_dataloader:
                    batch = DataProto.from_single_dict(batch_dict)
                    batch.non_tensor_batch["uid"] = np.array([str(uuid.uuid4()) for _ in range(len(batch))],
                                                             dtype=object)
                    self._pending.extend(batch[i:i + 1] for i in range(len(batch)))
                    while self._pending:
                        yield self._pending.popleft()

        def _save_stream(self, version: int, synced: bool, queued: list[Any], inflight: list[Any]) -> int:
            """Save the prompts taken and not trained (:mod:`.checkpoint`) into this step's checkpoint folder,
            before verl's ``_save_checkpoint`` (which writes the latest-step tracker last); returns their count."""
            folder = step_folder(self.config.trainer.default_local_dir, self.global_steps)
            pending = list(getattr(self, "_pending", ()))
            rows = untrained_prompts(queued, inflight, pending)
            state = StreamState(step=self.global_steps, param_version=checkpoint_version(version, synced),
                                epoch=getattr(self, "_epoch", 0), carried=len(rows), queued=len(queued),
                                inflight=len(inflight), not_started=len(pending))
            save_stream(folder, state, rows)
            print(f"fully async: checkpoint at update {self.global_steps}: {len(rows)} prompts taken and not "
                  f"trained saved to start again on resume ({len(queued)} queued, {len(inflight)} in flight, "
                  f"{len(pending)} not started), weight version {state.param_version}")
            return len(rows)

        def _start(self, prompt: Any, worker: Any) -> tuple[Any, Any]:
            """Send ``prompt`` (one row, left untouched: a checkpoint may save it) as a group of n requests to the
            agent-loop ``worker``; returns the result's ref and the group's rows (the prompt without the keys
            verl's ``_get_gen_batch`` moves into the request)."""
            n = self.config.actor_rollout_ref.rollout.n
            work = DataProto(batch=None if prompt.batch is None else prompt.batch.clone(),
                             non_tensor_batch=dict(prompt.non_tensor_batch), meta_info=dict(prompt.meta_info))
            gen = self._get_gen_batch(work).repeat(repeat_times=n, interleave=True)  # pops keys from work
            gen.non_tensor_batch["agent_name"] = np.array([AGENT_NAME] * len(gen), dtype=object)
            gen.meta_info["global_steps"] = self.global_steps
            return worker.generate_sequences.remote(gen), work.repeat(repeat_times=n, interleave=True)

        def _score(self, rows: Any, out: Any) -> Any:
            out.meta_info.pop("timing", None)
            out.meta_info.pop("metrics", None)
            return attach_rewards(rows.union(out), self.reward_fn)

        def _compute_old_log_prob(self, batch: Any, metrics: dict, timing_raw: dict) -> Any:
            if self.fa.use_rollout_log_probs:  # what verl's compute_log_prob would have added besides the values
                batch.batch["old_log_probs"] = batch.batch["rollout_log_probs"]
                batch.meta_info["temperature"] = self.config.actor_rollout_ref.rollout.temperature
                return batch
            return super()._compute_old_log_prob(batch, metrics, timing_raw)

        def _rollout_correction(self, batch: Any, metrics: dict) -> Any:
            if self.fa.use_rollout_log_probs:  # the old log-probs are the rollout's: the PPO ratio is the correction
                return batch
            return super()._rollout_correction(batch, metrics)

        def _train(self, batch: Any, version: int) -> dict[str, Any]:
            """One actor update on ``batch`` (in the training thread); its metrics."""
            metrics: dict[str, Any] = {}
            timing_raw: dict[str, float] = {}
            metrics.update(staleness_metrics(version, batch.non_tensor_batch["param_version_start"].tolist()))
            with marked_timer("step", timing_raw):
                batch = self._update_on_batch(batch, metrics, timing_raw)
            dump_dir = self.config.trainer.get("rollout_data_dir", None)
            if dump_dir:  # verl's rollout dump (<dir>/<step>.jsonl: prompt, response, score per sample)
                self._log_rollout_data(batch, {}, timing_raw, dump_dir)
            metrics.update(compute_data_metrics(batch=batch, use_critic=self.use_critic))
            metrics.update(compute_timing_metrics(batch=batch, timing_raw=timing_raw))
            metrics["_num_resumes"] = batch.non_tensor_batch["num_resumes"].tolist()
            return metrics

        def fit(self) -> None:  # noqa: C901 - the streaming loop, step by step
            from omegaconf import OmegaConf

            fa = self.fa
            logger = Tracking(project_name=self.config.trainer.project_name,
                              experiment_name=self.config.trainer.experiment_name,
                              default_backend=self.config.trainer.logger,
                              config=OmegaConf.to_container(self.config, resolve=True))
            self.global_steps = 0
            self._load_checkpoint()  # verl's: the actor (weights, optimizer) and the dataloader position
            version, carried, start_epoch = 0, [], 0
            if self.global_steps > 0:  # resumed: the rollout still holds the initial weights
                folder = resume_folder(self.config.trainer, self.global_steps)
                state, carried = load_stream(folder)
                if state is None:
                    version = -(-self.global_steps // fa.trigger_parameter_sync_step)
                    print(f"fully async: {folder} has no {STATE_FILE}: the prompts in flight at that save are "
                          "lost, the dataloader continues after them")
                else:
                    version, start_epoch = state.param_version, state.epoch
                # the loaded weights reach the rollout before any generation (validation included)
                sync = self.sync_weights(version)
                print(f"fully async: resumed at update {self.global_steps} from {folder}, weight version {version},"
                      f" {len(carried)} prompts carried over (started first): {sync}")
            manager = self.async_rollout_manager
            sd_hooks = manager.qwen3_rl_hooks
            _, sd_state = spec_decode_since(sd_hooks, manager.server_handles, None)
            if self.val_reward_fn is not None and self.config.trainer.get("val_before_train", True):
                val = self._validate()
                pprint(f"Initial validation metrics: {val}")
                logger.log(data=val, step=self.global_steps)
                _, sd_state = spec_decode_since(sd_hooks, manager.server_handles, None)
            total = self.total_training_steps
            # ref -> (prompt row, its n rows) while running, then (prompt row, scored group) once finished
            stream = PromptStream(version_quota(fa.prompts_per_version, fa.staleness_threshold), version)
            prompts = self._prompts(carried, start_epoch)
            to_start = (total - self.global_steps) * fa.prompts_per_update
            updates, resumed_total = self.global_steps, 0
            manager.resume(version)
            rr = 0
            pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fully_async_train")
            training: Future | None = None
            workers = manager.agent_loop_workers
            t_version = time.perf_counter()
            while updates < total:
                # 1. keep the rollout fed within the staleness bound
                while to_start > 0 and stream.may_start():
                    try:
                        prompt = next(prompts)
                    except StopIteration:
                        to_start = 0
                        break
                    ref, rows = self._start(prompt, workers[rr % len(workers)])
                    rr += 1
                    stream.start(ref, (prompt, rows))
                    to_start -= 1
                inflight = stream.inflight
                if (to_start == 0 and not inflight and training is None
                        and len(stream.ready) < fa.prompts_per_update):
                    raise RuntimeError(f"fully async: the prompts ran out after {updates} of {total} updates "
                                       "(trainer.total_epochs x the dataset is too small for the run)")
                # 2. finished groups -> the queue
                if inflight:
                    done, _ = ray.wait(list(inflight), num_returns=len(inflight), timeout=0.05)
                    for ref in done:
                        prompt, rows = inflight[ref][0]
                        stream.finish(ref, (prompt, self._score(rows, ray.get(ref))))
                else:
                    time.sleep(0.05)
                # 3. an update on the oldest finished groups
                taken = stream.take_batch(fa.prompts_per_update) if training is None else None
                if taken is not None:
                    batch = DataProto.concat([group for (_, group), _ in taken])
                    self.global_steps = updates + 1
                    training = pool.submit(self._train, batch, version)
                # 4. a finished update (and a weight sync after every trigger_parameter_sync_step of them)
                if training is not None and training.done():
                    metrics = training.result()
                    training = None
                    updates += 1
                    rm, resumed_total = resume_metrics(metrics.pop("_num_resumes"), resumed_total)
                    metrics.update(rm)
                    last = updates >= total
                    synced = updates % fa.trigger_parameter_sync_step == 0 or last
                    if synced:
                        sd, sd_state = spec_decode_since(sd_hooks, manager.server_handles, sd_state)
                        metrics.update(sd)
                        metrics["fully_async/count/started_in_version"] = float(stream.started_in_version)
                        metrics["timing_s/fully_async/version"] = time.perf_counter() - t_version
                        version += 1
                        metrics.update(self.sync_weights(version))
                        stream.new_version(version)
                        t_version = time.perf_counter()
                    metrics["fully_async/count/current_param_version"] = float(version)
                    metrics["fully_async/count/queued_groups"] = float(len(stream.ready))
                    metrics["fully_async/count/inflight_groups"] = float(len(stream.inflight))
                    test_freq = self.config.trainer.test_freq
                    if self.val_reward_fn is not None and test_freq > 0 and (last or updates % test_freq == 0):
                        with marked_timer("testing", metrics):
                            metrics.update(self._validate())
                        _, sd_state = spec_decode_since(sd_hooks, manager.server_handles, None)
                    save_freq = self.config.trainer.save_freq
                    if save_freq > 0 and (last or updates % save_freq == 0):
                        with marked_timer("timing_s/fully_async/save_checkpoint", metrics):
                            carried_n = self._save_stream(version, synced, [p for (p, _), _ in stream.ready],
                                                          [p for (p, _), _ in stream.inflight.values()])
                            self._save_checkpoint()
                        metrics["fully_async/checkpoint/carried_prompts"] = float(carried_n)
                    metrics.update({"training/global_step": updates, "training/epoch": getattr(self, "_epoch", 0)})
                    logger.log(data=metrics, step=updates)
            pool.shutdown()
            print(f"fully async: {updates} updates, {version} weight versions, {resumed_total} resumed trajectories")

    return FullyAsyncTrainer


def weight_sync_backend(tensor_device: str) -> str:
    """The weight-sync group's collective backend for the device the trainer's weights live on (``tensor_device``,
    reported by the trainer's rank 0 worker, which holds them: ``npu`` on an Ascend node, ``cpu`` on the CPU
    profile, whose scripts also say ``trainer.device=npu`` for the Ray resource). Not from a device probe where
    this runs: verl's ``TaskRunner`` is a Ray actor without devices (Ray sets ``ASCEND_RT_VISIBLE_DEVICES=""``)."""
    from qwen3_rl.trainer.fully_async.weight_sync import collective_backend

    return collective_backend(tensor_device)


class _TaskRunnerMixin:
    """verl's ``TaskRunner`` with ``FullyAsyncTrainer`` in place of ``RayPPOTrainer`` (datasets, reward managers,
    tokenizer built exactly as verl builds them)."""

    def run(self, config: Any) -> None:
        import verl.trainer.main_ppo as main_ppo

        AsyncSettings.from_config(config)
        main_ppo.RayPPOTrainer = make_fully_async_trainer_class()
        return super().run(config)  # type: ignore[misc]


def run_fully_async(config: Any) -> None:
    """Validate the ``async_training`` group, then run verl's ``run_ppo`` with our task runner."""
    import ray
    from verl.trainer.main_ppo import TaskRunner, run_ppo

    AsyncSettings.from_config(config)
    runner = type("FullyAsyncTaskRunner", (_TaskRunnerMixin, TaskRunner), {})
    run_ppo(config, task_runner_class=ray.remote(num_cpus=1)(runner))
