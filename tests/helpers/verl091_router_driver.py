"""Group routing through verl 0.9.1's own router factory and client: ``get_router_handle`` (with and without
``router_config_path``) builds the load-balancer Ray actor, ``LLMServerClient.generate`` acquires and releases
through it, in a local Ray on 127.0.0.1.

    python tests/helpers/verl091_router_driver.py OUT.json ROUTER.yaml

The servers are two Ray actors that record which prompts reach them and answer with verl's
``TokenOutput`` (the prompt's first token, echoed): what this driver checks is which server a request reaches,
decided before any engine runs. Four prompts x four samples go out as verl's single-turn agent loop sends them
(a fresh uuid per sample, all at once, from two clients = two agent-loop workers sharing the one balancer), in two
generation batches; then a two-turn request (the same request id twice, the second prompt longer).
Runs: ``default`` (verl's sticky + least-in-flight balancer) and ``group`` (the YAML's plugin).
OUT.json: {run: {"batches": [[[server index per sample] per prompt] per batch], "turns": [server, server],
"inflight_after": int, "status": {...}, "counts": {...}}}.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from uuid import uuid4

PROMPTS = [[11, 12, 13, 14], [21, 22, 23], [31, 32, 33, 34, 35], [41, 42]]
N_SAMPLES = 4


async def _one(client, rid: str, prompt: list[int]) -> None:
    await client.generate(rid, prompt_ids=prompt, sampling_params={"temperature": 1.0})


async def drive(handles: list, clients: list, ray) -> dict:
    """Two generation batches of PROMPTS x N_SAMPLES over ``clients``, then a two-turn request; per sample the index
    of the server that got it (the server sees verl's own fresh id per turn, ``_vllm_request_id``, so a sample is
    known by its prompt)."""

    async def batch() -> list[list[int]]:
        await asyncio.gather(
            *(
                _one(clients[(p * N_SAMPLES + s) % 2], uuid4().hex, prompt)
                for p, prompt in enumerate(PROMPTS)
                for s in range(N_SAMPLES)
            )
        )
        where: list[list[int]] = [[] for _ in PROMPTS]
        for i, h in enumerate(handles):
            for _rid, prompt in ray.get(h.take.remote()):
                where[PROMPTS.index(prompt)].append(i)
        return where

    out = {"batches": [await batch(), await batch()], "turns": []}
    for prompt in (PROMPTS[0], PROMPTS[0] + [99, 98, 97]):
        await _one(clients[0], "conversation-1", prompt)
        out["turns"] += [i for i, h in enumerate(handles) if ray.get(h.take.remote())]
    return out


def main() -> int:
    out_path, yaml_path = sys.argv[1], sys.argv[2]
    os.environ["RAY_AUTH_MODE"] = "disabled"
    import ray
    from omegaconf import OmegaConf
    from verl.workers.rollout.llm_server import LLMServerClient
    from verl.workers.rollout.replica import TokenOutput
    from verl.workers.rollout.router import get_router_handle

    @ray.remote(num_cpus=0)
    class RecordingServer:
        def __init__(self) -> None:
            self.seen: list[tuple[str, list[int]]] = []

        async def generate(self, request_id: str, prompt_ids: list[int], sampling_params: dict, **_: object):
            self.seen.append((request_id, list(prompt_ids)))
            await asyncio.sleep(0.05)  # requests overlap, as on a real server
            return TokenOutput(token_ids=[prompt_ids[0]], extra_fields={})

        def take(self) -> list:
            out, self.seen = self.seen, []
            return out

    config = OmegaConf.create({"actor_rollout_ref": {"rollout": {"name": "vllm", "full_determinism": False}}})
    ray.init(
        address="local",
        num_cpus=2,
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        log_to_driver=False,
    )
    try:
        results = {}
        for run, router_yaml in (("default", None), ("group", yaml_path)):
            handles = [RecordingServer.remote() for _ in range(2)]
            servers = {f"127.0.0.1:{9000 + i}": h for i, h in enumerate(handles)}
            balancer = get_router_handle(servers, router_config_path=router_yaml)
            clients = [LLMServerClient(config, load_balancer_handle=balancer) for _ in range(2)]

            res = asyncio.run(drive(handles, clients, ray))
            res["inflight_after"] = ray.get(balancer.get_total_inflight.remote())
            res["status"] = ray.get(balancer.get_status.remote())
            res["fields"] = ray.get(balancer.require_acquire_fields.remote())
            if run == "group":
                res["counts"] = ray.get(balancer.take_routing_counts.remote())
            results[run] = res
            for h in [*handles, balancer]:
                ray.kill(h)
    finally:
        ray.shutdown()
    with open(out_path, "w") as f:
        json.dump(results, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
