"""``python -m qwen3_rl launch k8s``: the Volcano Job and the MindCluster AscendJob validate against the CRDs'
published schemas (tests/data/crd, sources in tests/data/crd/SOURCE.md) and carry what a run needs.

Validation: the CRD's ``openAPIV3Schema`` with jsonschema (Draft 7). Kubernetes drops fields a structural schema
does not name (and ``kubectl --validate=strict`` refuses them), which plain JSON schema allows; so every object
schema that lists ``properties`` and neither ``additionalProperties`` nor ``x-kubernetes-preserve-unknown-fields``
is made closed first. Negative controls: a misspelt field, a wrong type and a missing required field are refused.
"""

from __future__ import annotations

import copy
import subprocess
import sys
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from qwen3_rl.tools.launch.k8s import K8sError, build

REPO = Path(__file__).resolve().parents[3]
CRD = REPO / "tests" / "data" / "crd"
SETUP = "internal/train_grpo_qwen3_235b_128die_true_weight.sh"  # trainer.nnodes=8 by default


def _closed(schema: Any) -> Any:
    if isinstance(schema, dict):
        out = {k: _closed(v) for k, v in schema.items()}
        if (out.get("type") == "object" and "properties" in out and "additionalProperties" not in out
                and not out.get("x-kubernetes-preserve-unknown-fields")):
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [_closed(v) for v in schema]
    return schema


@cache
def validator(kind: str) -> jsonschema.Draft7Validator:
    f, version = {"Job": ("batch.volcano.sh_jobs.yaml", "v1alpha1"),
                  "AscendJob": ("mindxdl.gitee.com_ascendjobs.yaml", "v1")}[kind]
    crd = yaml.safe_load((CRD / f).read_text())
    assert crd["kind"] == "CustomResourceDefinition" and crd["spec"]["names"]["kind"] == kind
    (ver,) = [v for v in crd["spec"]["versions"] if v["name"] == version]
    schema = _closed(ver["schema"]["openAPIV3Schema"])
    jsonschema.Draft7Validator.check_schema(schema)
    return jsonschema.Draft7Validator(schema)


def errors(doc: dict[str, Any]) -> list[str]:
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator(doc["kind"]).iter_errors(doc)]


def _manifest(*args: str) -> dict[str, Any]:
    doc, _ = build(["--setup", SETUP, "--image", "registry.example/qwen3-rl:1", *args])
    return doc


def _containers(doc: dict[str, Any]) -> dict[str, tuple[int, dict[str, Any], dict[str, Any]]]:
    """role -> (replicas, pod spec, container)."""
    if doc["kind"] == "Job":
        items = [(t["name"], t) for t in doc["spec"]["tasks"]]
    else:
        items = list(doc["spec"]["replicaSpecs"].items())
    return {name: (t["replicas"], t["template"]["spec"], t["template"]["spec"]["containers"][0]) for name, t in items}


def _check_pod(spec: dict[str, Any], c: dict[str, Any], nodes: int) -> dict[str, str]:
    assert spec["hostNetwork"] is True and spec["dnsPolicy"] == "ClusterFirstWithHostNet"
    assert spec["schedulerName"] == "volcano"
    assert c["image"] == "registry.example/qwen3-rl:1"
    assert c["resources"]["limits"] == c["resources"]["requests"] == {"huawei.com/Ascend910": "16"}
    assert c["command"][:5] == ["bash", "ray_start_npu.sh", SETUP, "--nnodes", str(nodes)]
    assert c["workingDir"] == "/workspace/qwen3-rl"
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    assert mounts["workspace"] == "/workspace" and mounts["dshm"] == "/dev/shm"
    vols = {v["name"]: v for v in spec["volumes"]}
    assert vols["workspace"]["persistentVolumeClaim"]["claimName"] == "qwen3-rl-workspace"
    assert vols["ascend-driver"]["hostPath"]["path"] == "/usr/local/Ascend/driver"
    token = c["command"][c["command"].index("--auth-token-file") + 1]
    assert token.startswith("/workspace/qwen3-rl/"), "the Ray token file must be on the shared workspace volume"
    return {e["name"]: e["value"] for e in c["env"]}


def test_volcano_job_validates_and_has_head_and_workers():
    doc = _manifest()
    assert errors(doc) == []
    assert doc["apiVersion"] == "batch.volcano.sh/v1alpha1" and doc["spec"]["minAvailable"] == 8
    assert "svc" in doc["spec"]["plugins"]
    roles = _containers(doc)
    assert {k: v[0] for k, v in roles.items()} == {"head": 1, "worker": 7}
    name = doc["metadata"]["name"]
    for _, spec, c in roles.values():
        env = _check_pod(spec, c, 8)
        assert env == {"SOCKET_IFNAME": "eth0", "MASTER_ADDR": f"{name}-head-0.{name}"}
    head = next(t for t in doc["spec"]["tasks"] if t["name"] == "head")
    assert head["policies"] == [{"event": "TaskCompleted", "action": "CompleteJob"}]


def test_one_node_has_no_worker_task():
    doc = _manifest("--nodes", "1", "--ifname", "enp189s0f0")
    assert errors(doc) == []
    roles = _containers(doc)
    assert list(roles) == ["head"] and doc["spec"]["minAvailable"] == 1
    assert _check_pod(roles["head"][1], roles["head"][2], 1)["SOCKET_IFNAME"] == "enp189s0f0"


def test_ascend_job_validates_with_master_and_workers():
    doc = _manifest("--kind", "ascendjob", "--nodes", "2")
    assert errors(doc) == []
    assert doc["apiVersion"] == "mindxdl.gitee.com/v1" and doc["kind"] == "AscendJob"
    assert doc["metadata"]["labels"]["framework"] == "pytorch"
    assert doc["metadata"]["labels"]["ring-controller.atlas"] == "ascend-910b"
    assert doc["spec"]["runPolicy"]["schedulingPolicy"]["minAvailable"] == 2
    roles = _containers(doc)
    assert {k: v[0] for k, v in roles.items()} == {"Master": 1, "Worker": 1}
    for _, spec, c in roles.values():
        assert c["name"] == "ascend"  # ascend-operator finds the container by this name
        env = _check_pod(spec, c, 2)
        assert "MASTER_ADDR" not in env  # ascend-operator sets it to the master pod's address


@pytest.mark.parametrize("kind", ["volcano", "ascendjob"])
def test_schema_refuses_broken_manifests(kind: str):
    """Negative controls: the closed schema refuses a misspelt field, a wrong type, a missing required field."""
    doc = _manifest("--kind", kind, "--nodes", "2")
    role = "tasks" if kind == "volcano" else "replicaSpecs"

    def first(d: dict[str, Any]) -> dict[str, Any]:
        return d["spec"]["tasks"][0] if role == "tasks" else next(iter(d["spec"]["replicaSpecs"].values()))

    typo = copy.deepcopy(doc)
    c = first(typo)["template"]["spec"]["containers"][0]
    c["imagePullPolicyy"] = c.pop("imagePullPolicy")
    assert any("imagePullPolicyy" in e for e in errors(typo)), errors(typo)
    wrong = copy.deepcopy(doc)
    first(wrong)["replicas"] = "two"
    assert any("replicas" in e and "is not of type 'integer'" in e for e in errors(wrong)), errors(wrong)
    missing = copy.deepcopy(doc)
    del first(missing)["template"]["spec"]["containers"][0]["name"]
    assert any("'name' is a required property" in e for e in errors(missing)), errors(missing)


def test_cli_writes_yaml_and_refuses_bad_input(tmp_path: Path):
    out = tmp_path / "job.yaml"
    p = subprocess.run([sys.executable, "-m", "qwen3_rl", "launch", "k8s", "--setup", SETUP, "--nodes", "4",
                        "--image", "img:1", "--out", str(out)], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    doc = yaml.safe_load(out.read_text())
    assert errors(doc) == [] and doc["spec"]["minAvailable"] == 4
    p = subprocess.run([sys.executable, "-m", "qwen3_rl", "launch", "k8s", "--setup", "internal/none.sh",
                        "--image", "img:1"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and p.stderr.strip() == "error: setup not found: internal/none.sh"
    with pytest.raises(K8sError, match="--npus-per-node=99 must be in 1..64"):
        _manifest("--npus-per-node", "99")
