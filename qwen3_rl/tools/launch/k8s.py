"""``python -m qwen3_rl launch k8s --setup SCRIPT [--nodes N]``: a Kubernetes job for a train script.

Two kinds, both scheduled by Volcano (gang: all pods or none):

- ``volcano`` (default): a Volcano ``batch.volcano.sh/v1alpha1`` ``Job`` with a ``head`` task (1 pod) and a
  ``worker`` task (N-1 pods). Volcano's ``svc`` plugin gives every pod a DNS name; ``MASTER_ADDR`` is the head
  pod's (``<job>-head-0.<job>``). The job completes when the head task does (the workers then leave by
  themselves) and is aborted when any pod fails.
- ``ascendjob``: MindCluster's ``mindxdl.gitee.com/v1`` ``AscendJob`` (ascend-operator) with ``Master`` and
  ``Worker`` replicas, ``framework: pytorch`` and the ``ring-controller.atlas`` label; ascend-operator sets
  ``MASTER_ADDR`` to the master pod's address.

Every pod: ``huawei.com/Ascend910`` NPUs (requests = limits), host network (HCCL and Ray use the node's own
interfaces; ``SOCKET_IFNAME`` names the one for HCCL/GLOO sockets), the image, the workspace volume (a shared
PVC holding this checkout, models and data), the Ascend driver files from the host, a memory-backed ``/dev/shm``,
and the same command on every pod: ``bash ray_start_npu.sh SCRIPT --nnodes N --npus-per-node M`` (so the
launcher's preflight, environment contract, CPU binding and bounded waits stay). Ray token auth: the head writes
one token per run to ``--auth-token-file`` on the workspace volume, the workers read it there.

The output is validated against the CRDs' published schemas in tests/tools/launch/test_launch_k8s.py (copies under
tests/data/crd).
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Any

from qwen3_rl.tools.launch.train_script import TrainScriptError, parse_train_script

REPO = Path(__file__).resolve().parents[3]
NPU_RESOURCE = "huawei.com/Ascend910"
# host paths of the Ascend driver stack every NPU container mounts (as run_container.sh does)
DRIVER_MOUNTS = {"ascend-driver": "/usr/local/Ascend/driver", "ascend-dcmi": "/usr/local/dcmi",
                 "npu-smi": "/usr/local/bin/npu-smi"}


class K8sError(ValueError):
    """Bad input (one-line message)."""


def _dns_name(text: str) -> str:
    name = re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-")
    return name[:40].rstrip("-") or "qwen3-rl"


def setup_nodes(setup: Path) -> int:
    """``trainer.nnodes`` of the setup's final command (its own default)."""
    try:
        cmd = parse_train_script(str(setup), env={})
    except TrainScriptError as exc:
        raise K8sError(str(exc)) from None
    for o in cmd.overrides:
        if o.startswith("trainer.nnodes="):
            return int(o.split("=", 1)[1])
    raise K8sError(f"{setup}: no trainer.nnodes in its command; give --nodes")


def _container(a: argparse.Namespace, nodes: int, master_env: bool, name: str) -> dict[str, Any]:
    repo = f"{a.workspace_mount.rstrip('/')}/{a.repo_dir}"
    token = a.auth_token_file or f"{repo}/logs/.ray_auth_token_{name}"
    cmd = ["bash", "ray_start_npu.sh", a.setup, *([a.env_script] if a.env_script else []), "--nnodes", str(nodes),
           "--npus-per-node", str(a.npus_per_node), "--auth-token-file", token, *a.launcher_arg]
    env = [{"name": "SOCKET_IFNAME", "value": a.ifname}]
    if master_env:
        env.append({"name": "MASTER_ADDR", "value": f"{name}-head-0.{name}"})
    mounts = [{"name": "workspace", "mountPath": a.workspace_mount}, {"name": "dshm", "mountPath": "/dev/shm"}]
    mounts += [{"name": k, "mountPath": v, "readOnly": True} for k, v in DRIVER_MOUNTS.items()]
    npus = {NPU_RESOURCE: str(a.npus_per_node)}
    return {"name": "ascend", "image": a.image, "imagePullPolicy": "IfNotPresent", "workingDir": repo,
            "command": cmd, "env": env, "resources": {"requests": dict(npus), "limits": dict(npus)},
            "volumeMounts": mounts}


def _pod_spec(a: argparse.Namespace, container: dict[str, Any]) -> dict[str, Any]:
    volumes: list[dict[str, Any]] = [
        {"name": "workspace", "persistentVolumeClaim": {"claimName": a.workspace_pvc}},
        {"name": "dshm", "emptyDir": {"medium": "Memory"}},
    ]
    volumes += [{"name": k, "hostPath": {"path": v}} for k, v in DRIVER_MOUNTS.items()]
    return {"hostNetwork": True, "dnsPolicy": "ClusterFirstWithHostNet", "schedulerName": "volcano",
            "restartPolicy": "Never", "containers": [container], "volumes": volumes}


def volcano_job(a: argparse.Namespace, nodes: int) -> dict[str, Any]:
    """A ``batch.volcano.sh/v1alpha1`` ``Job``: head task + worker task, gang-scheduled."""
    name = a.name
    labels = {"app": "qwen3-rl", "ring-controller.atlas": a.ring_controller}
    tasks = []
    for task, replicas in (("head", 1), ("worker", nodes - 1)):
        if replicas == 0:
            continue
        t: dict[str, Any] = {"name": task, "replicas": replicas,
                             "template": {"metadata": {"labels": dict(labels)},
                                          "spec": _pod_spec(a, _container(a, nodes, True, name))}}
        if task == "head":
            t["policies"] = [{"event": "TaskCompleted", "action": "CompleteJob"}]
        tasks.append(t)
    return {"apiVersion": "batch.volcano.sh/v1alpha1", "kind": "Job",
            "metadata": {"name": name, "namespace": a.namespace, "labels": dict(labels)},
            "spec": {"schedulerName": "volcano", "minAvailable": nodes, "queue": a.queue, "maxRetry": 0,
                     "plugins": {"svc": [], "env": []},
                     "policies": [{"event": "PodFailed", "action": "AbortJob"},
                                  {"event": "PodEvicted", "action": "AbortJob"}],
                     "tasks": tasks}}


def ascend_job(a: argparse.Namespace, nodes: int) -> dict[str, Any]:
    """MindCluster's ``mindxdl.gitee.com/v1`` ``AscendJob``: Master + Worker replicas (ascend-operator)."""
    name = a.name
    labels = {"app": "qwen3-rl", "framework": "pytorch", "ring-controller.atlas": a.ring_controller}
    replicas: dict[str, Any] = {}
    for role, count in (("Master", 1), ("Worker", nodes - 1)):
        if count == 0:
            continue
        replicas[role] = {"replicas": count, "restartPolicy": "Never",
                          "template": {"metadata": {"labels": {"ring-controller.atlas": a.ring_controller}},
                                       "spec": _pod_spec(a, _container(a, nodes, False, name))}}
    return {"apiVersion": "mindxdl.gitee.com/v1", "kind": "AscendJob",
            "metadata": {"name": name, "namespace": a.namespace, "labels": labels},
            "spec": {"schedulerName": "volcano",
                     "runPolicy": {"schedulingPolicy": {"minAvailable": nodes, "queue": a.queue}},
                     "successPolicy": "", "replicaSpecs": replicas}}


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m qwen3_rl launch k8s",
                                 description="Write a Volcano Job (or a MindCluster AscendJob) that runs SETUP with "
                                             "ray_start_npu.sh on every pod.")
    ap.add_argument("--setup", required=True, help="train script, relative to the checkout (internal/train_*.sh)")
    ap.add_argument("--env-script", default="", help="env script passed to ray_start_npu.sh (relative to the checkout)")
    ap.add_argument("--nodes", type=int, help="pods = nodes (default: the setup's trainer.nnodes)")
    ap.add_argument("--npus-per-node", type=int, default=16, help="NPUs per pod (huawei.com/Ascend910; default 16)")
    ap.add_argument("--kind", choices=["volcano", "ascendjob"], default="volcano")
    ap.add_argument("--name", help="job name (default: from the setup's file name)")
    ap.add_argument("--namespace", default="default")
    ap.add_argument("--queue", default="default", help="Volcano queue")
    ap.add_argument("--image", required=True, help="the recipe image (Dockerfile.vllm_ascend.mindspeed.qwen3)")
    ap.add_argument("--workspace-pvc", default="qwen3-rl-workspace",
                    help="PVC (ReadWriteMany) holding the checkout, models and data")
    ap.add_argument("--workspace-mount", default="/workspace", help="where the PVC is mounted")
    ap.add_argument("--repo-dir", default="qwen3-rl", help="the checkout's folder inside the workspace")
    ap.add_argument("--ifname", default="eth0", help="host interface for HCCL/GLOO sockets (SOCKET_IFNAME)")
    ap.add_argument("--ring-controller", default="ascend-910b", help="MindCluster's ring-controller.atlas label")
    ap.add_argument("--auth-token-file", default="",
                    help="Ray token file on the workspace volume (default <checkout>/logs/.ray_auth_token_<name>)")
    ap.add_argument("--launcher-arg", action="append", default=[], metavar="ARG",
                    help="extra ray_start_npu.sh argument, repeatable")
    ap.add_argument("--out", help="write here instead of stdout")
    return ap


def build(argv: list[str]) -> tuple[dict[str, Any], argparse.Namespace]:
    """Parse ``argv`` and return the manifest (a dict) and the parsed options.

    Raises:
        K8sError: a bad value (one line).
    """
    a = _parser().parse_args(argv)
    setup = (REPO / a.setup) if not Path(a.setup).is_absolute() else Path(a.setup)
    if not setup.is_file():
        raise K8sError(f"setup not found: {a.setup}")
    nodes = a.nodes if a.nodes is not None else setup_nodes(setup)
    if nodes < 1:
        raise K8sError(f"--nodes={nodes} must be >= 1")
    if not 1 <= a.npus_per_node <= 64:
        raise K8sError(f"--npus-per-node={a.npus_per_node} must be in 1..64")
    a.name = _dns_name(a.name or setup.stem.removeprefix("train_"))
    doc = volcano_job(a, nodes) if a.kind == "volcano" else ascend_job(a, nodes)
    return doc, a


def main(argv: list[str]) -> int:
    try:
        doc, a = build(argv)
    except K8sError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        import yaml
    except ImportError:
        print(f"error: launch k8s writes the manifest with PyYAML, which {sys.executable} lacks: "
              "pip install pyyaml", file=sys.stderr)
        return 2
    text = yaml.safe_dump(doc, sort_keys=False, default_flow_style=False)
    if a.out:
        Path(a.out).write_text(text)
        print(f"wrote {a.out}: {doc['kind']} {a.name} ({a.kind})", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0
