"""Two hosts: the pipeline across two network namespaces, launched by torchrun on each, equals one process.

The test makes two network namespaces joined by a veth pair (10.250.0.1/24 and 10.250.0.2/24,
addresses that exist only inside these namespaces, so no traffic leaves them), starts
``torchrun --nnodes 2 --node-rank i --nproc-per-node 1`` inside each with the static rendezvous
on host 0's address and ``GLOO_SOCKET_IFNAME`` set to that namespace's veth, and runs this file
as the worker: a pipelined forward, a training step (gradients kept), greedy generation and
``save_pretrained`` to a directory both "hosts" see. Every number must equal transformers on one
process; each host must run the stage of its GLOBAL rank (its LOCAL_RANK is 0 on both), the
traffic must have crossed the veth, and each host must have written only its own files.

Needs root and iproute2 (``ip``); skipped with the reason otherwise.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import time

import pytest
import torch
import transformers

pytestmark = pytest.mark.dist  # every test here starts other processes

_HERE = pathlib.Path(__file__).resolve().parents[1]  # tests/: tiny.py and harness.py
_ROOT = _HERE.parent
_SUBNET = "10.250.0"
_PORT = 29500  # free: the namespaces are new, nothing else listens in them
_TOL = 1e-5  # fp32, same kernels; only summation order may differ


def _ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)


def _why_no_namespaces() -> str | None:
    if shutil.which("ip") is None:
        return "iproute2 (`ip`) is not installed: `apt-get install -y iproute2`"
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add)"
    return None


class _Hosts:
    """Two namespaces joined by a veth pair; removed again by :meth:`close` (deleting a namespace deletes its
    veth end)."""

    def __init__(self) -> None:
        tag = str(os.getpid())
        self.ns = (f"hfp{tag}a", f"hfp{tag}b")
        self.dev = (f"hfpv{tag}a", f"hfpv{tag}b")  # <= 15 characters, as Linux requires
        self.addr = (f"{_SUBNET}.1", f"{_SUBNET}.2")
        self.made: list[str] = []

    def open(self) -> None:
        _remove_stale()
        for ns in self.ns:
            res = _ip("netns", "add", ns)
            if res.returncode != 0:
                raise PermissionError(f"ip netns add {ns}: {res.stderr.strip()}")
            self.made.append(ns)
        steps = [("link", "add", self.dev[0], "type", "veth", "peer", "name", self.dev[1])]
        for ns, dev, addr in zip(self.ns, self.dev, self.addr):
            steps += [
                ("link", "set", dev, "netns", ns),
                ("-n", ns, "addr", "add", f"{addr}/24", "dev", dev),
                ("-n", ns, "link", "set", dev, "up"),
                ("-n", ns, "link", "set", "lo", "up"),
            ]
        for step in steps:
            res = _ip(*step)
            if res.returncode != 0:
                raise RuntimeError(f"ip {' '.join(step)} failed: {res.stderr.strip()}")

    def bytes_sent(self, i: int) -> int:
        res = subprocess.run(
            ["ip", "netns", "exec", self.ns[i], "cat", f"/sys/class/net/{self.dev[i]}/statistics/tx_bytes"],
            capture_output=True, text=True, timeout=30,
        )
        return int(res.stdout.strip() or 0)

    def close(self) -> None:
        for ns in self.made:
            _ip("netns", "del", ns)
        _ip("link", "del", self.dev[0])  # only if it never moved into a namespace


def _remove_stale() -> None:
    """Namespaces of earlier runs whose test process was killed before its ``finally`` (e.g. SIGKILL)."""
    import psutil

    for line in _ip("netns", "list").stdout.splitlines():
        m = re.fullmatch(r"hfp(\d+)[ab]", line.split()[0]) if line.strip() else None
        if m and not psutil.pid_exists(int(m.group(1))):
            _ip("netns", "del", m.group(0))


def _launch(hosts: _Hosts, node: int, args: list[str], log: pathlib.Path) -> subprocess.Popen:
    env = {
        **os.environ,
        "GLOO_SOCKET_IFNAME": hosts.dev[node],
        "PYTHONPATH": os.pathsep.join([str(_ROOT), str(_HERE), os.environ.get("PYTHONPATH", "")]),
        "OMP_NUM_THREADS": "1",
        "HF_PIPELINE_THREADS": "1",
        "HF_PIPELINE_TIMEOUT": "60",
        "HF_HUB_OFFLINE": "1",
    }
    cmd = [
        "ip", "netns", "exec", hosts.ns[node],
        sys.executable, "-m", "torch.distributed.run",
        "--nnodes", "2", "--node-rank", str(node), "--nproc-per-node", "1",
        "--master-addr", hosts.addr[0], "--master-port", str(_PORT),
        str(pathlib.Path(__file__).resolve()), *args,
    ]
    return subprocess.Popen(cmd, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)


def _inputs():
    import tiny

    inputs = tiny.sample_inputs("llama", batch=4, seq=9)
    batch = {**inputs, "labels": inputs["input_ids"].masked_fill(inputs["attention_mask"] == 0, -100)}
    return inputs, batch, tiny.sample_inputs("llama", batch=4, seq=6)


def _worker(path: str, out: str) -> None:
    """Body of one rank (run by torchrun in a namespace)."""
    import hf_pipeline
    from hf_pipeline.distributed.context import init_distributed

    ctx = init_distributed(device="cpu")
    model = hf_pipeline.AutoModelForCausalLM.from_pretrained(path, pipeline=True, device="cpu", n_microbatches=2)
    inputs, batch, prompts = _inputs()
    logits = model(**inputs).logits
    loss = model.train_step(batch)
    grads = {name: p.grad.clone() for name, p in model.checkpoint_named_parameters()}
    ids = model.generate(**prompts, max_new_tokens=6, do_sample=False)
    # Which shard files this host writes, and with which keys (the directory is shared by both hosts).
    import safetensors.torch

    saved: dict[str, list[str]] = {}
    real_save_file = safetensors.torch.save_file

    def save_file(tensors, filename, metadata=None):
        saved[pathlib.Path(filename).name] = sorted(tensors)
        return real_save_file(tensors, filename, metadata=metadata)

    safetensors.torch.save_file = save_file
    model.save_pretrained(pathlib.Path(out) / "saved")
    safetensors.torch.save_file = real_save_file
    torch.save(
        {
            "rank": ctx.rank, "local_rank": ctx.local_rank, "world_size": ctx.world_size,
            "stages": [s.spec.index for s in model.stages], "plan": [(s.index, s.rank) for s in model.plan.stages],
            "ifname": os.environ.get("GLOO_SOCKET_IFNAME"), "master": os.environ.get("MASTER_ADDR"),
            "logits": logits, "loss": loss, "grads": grads, "ids": ids, "saved": saved,
            "files_opened": list(model.load_report.files_opened),
        },
        pathlib.Path(out) / f"rank{ctx.rank}.pt",
    )


def test_pipeline_across_two_hosts_equals_one_process(tmp_path):
    reason = _why_no_namespaces()
    if reason:
        pytest.skip(reason)
    import tiny

    path = tiny.make_checkpoint(tmp_path / "llama", "llama")
    out = tmp_path / "out"
    out.mkdir()
    hosts = _Hosts()
    procs: list[subprocess.Popen] = []
    logs = [tmp_path / f"host{i}.log" for i in range(2)]
    try:
        try:
            hosts.open()
        except PermissionError as e:
            pytest.skip(f"this machine does not allow network namespaces: {e}")
        procs = [_launch(hosts, i, ["--worker", str(path), str(out)], logs[i]) for i in range(2)]
        deadline = time.monotonic() + 240
        for p in procs:
            try:
                p.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        codes = [p.poll() for p in procs]
        if codes != [0, 0]:
            text = "\n".join(f"--- host {i} (exit {c}):\n{logs[i].read_text()[-4000:]}" for i, c in enumerate(codes))
            raise AssertionError(f"torchrun on the two hosts did not both succeed:\n{text}")
        sent = [hosts.bytes_sent(i) for i in range(2)]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, 9)
                p.wait(timeout=30)
        hosts.close()
    assert not any(ns in _ip("netns", "list").stdout for ns in hosts.ns), "namespaces were not removed"

    results = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]
    ref = tiny.reference(path, "AutoModelForCausalLM")
    inputs, batch, prompts = _inputs()
    with torch.no_grad():
        want_logits = ref(**inputs).logits
    train_ref = tiny.reference(path, "AutoModelForCausalLM")
    want_loss = train_ref(**batch).loss
    want_loss.backward()
    want_grads = dict(train_ref.named_parameters())
    want_ids = ref.generate(**prompts, max_new_tokens=6, do_sample=False)

    for rank, res in enumerate(results):
        # Host i runs global rank i with LOCAL_RANK 0: stages follow the global rank, traffic the veth.
        assert (res["rank"], res["local_rank"], res["world_size"]) == (rank, 0, 2)
        assert res["stages"] == [rank] and res["plan"] == [(0, 0), (1, 1)]
        assert res["ifname"] == hosts.dev[rank] and res["master"] == hosts.addr[0]
        assert (res["logits"] - want_logits).abs().max() <= _TOL, f"rank {rank} logits"
        assert abs(res["loss"].item() - want_loss.item()) <= _TOL, f"rank {rank} loss"
        assert torch.equal(res["ids"], want_ids), f"rank {rank} generated ids"
        assert res["grads"], rank
        for name, grad in res["grads"].items():
            diff = (grad - want_grads[name].grad).abs().max().item()
            assert diff <= _TOL, f"rank {rank} grad {name}: max abs diff {diff}"
    assert set(results[0]["grads"]).isdisjoint(results[1]["grads"])  # each host holds only its stage
    assert set(results[0]["grads"]) | set(results[1]["grads"]) == {n for n, _ in want_grads.items()}
    assert min(sent) > 10_000, f"bytes sent over the veth pair: {sent}"  # activations, gradients, tokens
    # save_pretrained to the shared directory: each host wrote only its own stage's tensors, into
    # its own files, and together they are the checkpoint transformers loads.
    index = json.loads((out / "saved" / "model.safetensors.index.json").read_text())["weight_map"]
    for rank, res in enumerate(results):
        assert res["saved"], f"rank {rank} wrote no shard"
        for name, keys in res["saved"].items():
            assert set(keys) <= set(res["grads"]), (rank, name, sorted(set(keys) - set(res["grads"])))
            assert all(index[k] == name for k in keys), (rank, name)
    assert set(results[0]["saved"]).isdisjoint(results[1]["saved"])
    assert {k for res in results for keys in res["saved"].values() for k in keys} == set(index)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out / "saved", dtype=torch.float32)
    for name, p in reloaded.state_dict().items():
        assert torch.equal(p, ref.state_dict()[name]), f"saved {name} differs"


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        _worker(sys.argv[2], sys.argv[3])
