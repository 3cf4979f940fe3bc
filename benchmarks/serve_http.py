"""Serve-http section, measuring side: real HTTP servers on 127.0.0.1 benchmarked by guidellm's own CLI.

For each model (the bundled tiny default model, and a decode-heavy random LLaMA whose decode step costs
several times a pipeline hop: :func:`benchmarks.checkpoints.decode_heavy_checkpoint`) and each concurrency,
``guidellm run`` (unpatched, offline, its ``concurrent`` profile, completions format) measures three
contenders, one after another, each a server started on a free port and stopped (all its processes) after:

  * ``served``: ``hf-pipeline serve`` at ``world`` ranks, one thread per rank;
  * ``replicas``: ``hf-pipeline serve`` at ``world`` ranks as ``world`` whole-model replicas (``--num-stages 1``),
    rank 0 planning every replica's continuous ring: what a model that fits one device should be served as, where
    a pipeline hop costs more than a stage's decode step (the tiny model);
  * ``one_process``: one ``transformers serve --continuous-batching`` process, one thread;
  * ``limit``: the machine's 2-way limit: that process and a second, independent one, each taking half of
    the same requests at once (two guidellm runs side by side, each at half the concurrency against its own
    server); throughput summed, time to first token and inter-token latency percentiles over both runs'
    requests. One stream cannot be split in two: at an odd concurrency the limit is not measured.

Every contender gets the same prompts (seeded random token ids of the model's tokenizer, decoded: a
``json_file`` for guidellm), greedy (``temperature`` 0), exactly ``max_tokens`` new tokens each: guidellm's
fixed lengths come with ``ignore_eos``, which ``transformers serve`` refuses (422, unknown field), so the
length is fixed through each server's own field (``ignore_eos`` for ``hf-pipeline serve``,
``generation_config={"eos_token_id": []}`` for transformers') with guidellm's ``max_tokens`` backend option.
The completions endpoint: the bundled model has no chat template in ``transformers serve``. Each server gets
one warm-up request before guidellm starts. guidellm itself runs on the same host: on a 2-core machine its
processes take part of the servers' CPU (the limit's two runs twice), one more reason for a quiet machine.

What a GPU run must show (one device per stage, ``--device cuda``; both servers on GPUs): the two stages
then own separate compute and memory bandwidth, so the 2-way limit is ~2x one process, and the served
pipeline at concurrency 8 should approach that limit (>= 0.95x) on the decode-heavy model, where a hop is
small next to a stage's step. On a CPU both processes share the memory bandwidth that bounds decode, so the
limit is small (about 1.1x one process) and so is any pipeline's gain.
"""

from __future__ import annotations

import json
import os
import pathlib
import random
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

from benchmarks.config import Sizes
from benchmarks.processes import ROOT, worker_env
from benchmarks.serve_http_results import contender_row, ratios
from devtools.process_tree import kill_tree

__all__ = ["CONTENDERS", "NO_EOS", "guidellm_command", "no_eos", "prompts", "run"]

CONTENDERS = ("served", "replicas", "one_process", "limit")
# Each server's own way of making a completion run to max_tokens (guidellm's ignore_eos is refused by
# transformers serve), and greedy for both.
NO_EOS = {
    "hf_pipeline": {"temperature": 0, "ignore_eos": True},
    "transformers": {"temperature": 0, "generation_config": json.dumps({"eos_token_id": []})},
}


def no_eos(kind: str) -> dict:
    """The request fields that make server ``kind``'s completions greedy and run to ``max_tokens`` (every
    ``hf-pipeline serve`` contender, replicas too, takes hf_pipeline's)."""
    return NO_EOS["hf_pipeline" if kind.startswith("hf_pipeline") else kind]
STARTUP_S = 600.0  # two ranks or a process importing torch and loading a 1 GB model on a loaded 2-core machine
PROMPT_SEED = 43


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class _Server:
    """A started server: its launcher process, port, log, kind, and (once up) every process it started."""

    proc: subprocess.Popen
    port: int
    log: pathlib.Path
    kind: str
    children: list = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_up(self, model: str) -> None:
        """Wait for ``/health``, note the processes, then one warm-up completion (lazy work is not timed)."""
        import httpx
        import psutil

        end = time.monotonic() + STARTUP_S
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.kind} exited with {self.proc.returncode}: {self.tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > end:
                raise RuntimeError(f"{self.kind} did not answer in {STARTUP_S} s: {self.tail()}")
            time.sleep(0.5)
        self.children = psutil.Process(self.proc.pid).children(recursive=True)
        body = {"model": model, "prompt": "Return the value.", "max_tokens": 2, **no_eos(self.kind)}
        httpx.post(f"{self.url}/v1/completions", json=body, timeout=STARTUP_S).raise_for_status()

    def tail(self) -> str:
        return self.log.read_text()[-1500:]

    def stop(self) -> None:
        """Stop the launcher's session and every process it started (hf-pipeline's ranks have sessions of their own)."""
        kill_tree(self.proc, self.children)


def _start(kind: str, model: str, log: pathlib.Path, sizes: Sizes, device: str) -> _Server:
    """``hf-pipeline serve`` at ``sizes.world`` ranks or one ``transformers serve --continuous-batching``, 1 thread;
    ``device``: cpu, or cuda (a device per rank; ``cuda:i`` for the i-th transformers process)."""
    port = _free_port()
    longest = sizes.http_prompt_tokens * 2 + sizes.http_output_tokens  # decoded prompts may re-tokenize longer
    top = max(sizes.http_concurrency)
    if kind.startswith("hf_pipeline"):
        # replicas: one stage, every rank a whole model with --max-batch rows of its own
        replicas = kind == "hf_pipeline_replicas"
        cmd = [sys.executable, "-m", "hf_pipeline.cli", "serve", model, "--num-processes", str(sizes.world),
               "--num-cpu-threads-per-process", "1", "--max-batch", str(-(-top // sizes.world) if replicas else top),
               "--dtype", "float32", "--device", device.split(":")[0], "--served-model-name", model,
               *(["--num-stages", "1"] if replicas else [])]
    else:
        block = 32
        # Sized for the load, as serve.py's continuous batching: the default sizes the cache from free memory.
        cmd = [shutil.which("transformers") or "transformers", "serve", model, "--continuous-batching",
               "--device", device, "--dtype", "float32", "--log-level", "warning", "--cb-block-size", str(block),
               "--cb-num-blocks", str(top * -(-longest // block) * 2), "--cb-max-batch-tokens", str(top * longest),
               "--max-model-len", str(longest)]
    cmd += ["--host", "127.0.0.1", "--port", str(port)]
    env = worker_env()
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=str(ROOT),
                                start_new_session=True)
    return _Server(proc=proc, port=port, log=log, kind=kind)


def prompts(model: str, n: int, tokens: int, seed: int = PROMPT_SEED) -> list[str]:
    """``n`` prompts: ``tokens`` seeded random token ids of ``model``'s tokenizer each, decoded."""
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(model)
    rng = random.Random(seed)
    special = set(tok.all_special_ids)
    ids = [i for i in range(len(tok)) if i not in special]
    return [tok.decode([rng.choice(ids) for _ in range(tokens)]) for _ in range(n)]


def guidellm_command(url: str, model: str, data: pathlib.Path, out: pathlib.Path, *, kind: str, streams: int,
                     requests: int, max_tokens: int) -> list[str]:
    """``guidellm run``: ``requests`` completions of ``data``'s prompts, ``streams`` at a time, greedy,
    ``max_tokens`` each (the server's own no-EOS field), offline with ``model``'s tokenizer."""
    backend = {"kind": "openai_http", "target": url, "model": model, "request_format": "/v1/completions",
               "max_tokens": max_tokens, "extras": {"body": no_eos(kind)}}
    return [shutil.which("guidellm") or "guidellm", "run", "--backend", json.dumps(backend),
            "--profile", f"kind=concurrent,streams={streams}", "--constraint", f"kind=max_requests,count={requests}",
            "--data", f"kind=json_file,path={data}", "--tokenizer", f"kind=huggingface_auto,model={model}",
            "--output", f"kind=json,path={out}", "--disable-console"]


def _guidellm(servers: list[_Server], model: str, texts: list[str], work: pathlib.Path, streams: int,
              max_tokens: int) -> list[dict]:
    """One guidellm run per server, side by side, each on its share of ``texts`` at its share of
    ``streams``; their JSON reports."""
    n = len(servers)
    procs, outs = [], []
    for i, server in enumerate(servers):
        share = texts[i::n]
        data, out = work / f"prompts{i}.jsonl", work / f"report{i}.json"
        data.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in share))
        out.unlink(missing_ok=True)
        cmd = guidellm_command(server.url, model, data, out, kind=server.kind, streams=streams // n,
                               requests=len(share), max_tokens=max_tokens)
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        outs.append(out)
    reports = []
    try:
        for proc, out in zip(procs, outs):
            text, _ = proc.communicate(timeout=3600)
            if proc.returncode != 0 or not out.is_file():
                raise RuntimeError(f"guidellm exited with {proc.returncode}: {text[-2000:]}")
            reports.append(json.loads(out.read_text()))
    finally:
        for proc in procs:  # a failed or timed-out run's twin does not outlive it
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return reports


def _measure(kinds: list[str], model: str, texts: dict[int, list[str]], sizes: Sizes, work: pathlib.Path,
             rows: dict, key: str, device: str, log) -> None:
    """Start one server per kind, run guidellm at every concurrency this contender can take, stop them."""
    servers = [_start(k, model, work / f"{key}-{i}.log", sizes, device if device == "cpu" else f"cuda:{i}")
               for i, k in enumerate(kinds)]
    try:
        for s in servers:
            s.wait_up(model)
        for c, share in texts.items():
            if c % len(servers):
                rows[c][key] = {"skipped": f"concurrency {c} cannot be split over {len(servers)} processes"}
                continue
            log(f"    {key}: concurrency {c}, {len(share)} requests")
            rows[c][key] = contender_row(_guidellm(servers, model, share, work, c, sizes.http_output_tokens))
    finally:
        for s in servers:
            s.stop()


def _model_section(name: str, model: str, sizes: Sizes, work: pathlib.Path, device: str, log) -> dict[str, Any]:
    """One model's rows by concurrency and contender, and the ratios."""
    counts = {c: max(sizes.http_min_requests, sizes.http_requests_per_stream * c) for c in sizes.http_concurrency}
    pool = prompts(model, max(counts.values()), sizes.http_prompt_tokens)
    texts = {c: pool[:n] for c, n in counts.items()}
    rows: dict[int, dict] = {c: {} for c in counts}
    for key, kinds in (("served", ["hf_pipeline"]), ("replicas", ["hf_pipeline_replicas"]),
                       ("one_process", ["transformers"]), ("limit", ["transformers", "transformers"])):
        log(f"  serve-http {name}: {key}")
        try:
            _measure(kinds, model, texts, sizes, work, rows, key, device, log)
        except Exception as e:  # noqa: BLE001 - reported in the results, the other contenders run
            for c in counts:
                rows[c].setdefault(key, {"error": f"{type(e).__name__}: {e}"})
    return {"path": model, "requests": {str(c): n for c, n in counts.items()},
            "concurrency": {str(c): {"contenders": r, "ratios": ratios(r)} for c, r in rows.items()}}


def run(sizes: Sizes, models: dict[str, str], *, device: str = "cpu", log=print) -> dict[str, Any]:
    """results.json's ``serve_http``: per model (name -> checkpoint folder), per concurrency, each contender's
    guidellm figures and the ratios; ``errors``: contenders that did not run or lost requests; ``device``: the
    servers' (cpu, or cuda: a GPU per stage and per transformers process)."""
    with tempfile.TemporaryDirectory(prefix="hf_pipeline_serve_http_") as tmp:
        return _run(sizes, models, pathlib.Path(tmp), device, log)


def _run(sizes: Sizes, models: dict[str, str], work: pathlib.Path, device: str, log) -> dict[str, Any]:
    result: dict[str, Any] = {
        "world": sizes.world, "device": device, "prompt_tokens": sizes.http_prompt_tokens,
        "output_tokens": sizes.http_output_tokens,
        "example_command": shlex.join(["guidellm", *guidellm_command(
            "URL", "MODEL", pathlib.Path("PROMPTS.jsonl"), pathlib.Path("OUT.json"), kind="hf_pipeline", streams=8,
            requests=32, max_tokens=sizes.http_output_tokens)[1:]]),
        "models": {name: _model_section(name, path, sizes, work, device, log) for name, path in models.items()},
    }
    errors = []
    for name, m in result["models"].items():
        for c, per in m["concurrency"].items():
            for key, row in per["contenders"].items():
                if "error" in row or row.get("errors"):
                    errors.append(f"serve-http {name} concurrency {c} {key}: {row.get('error') or row['errors']} "
                                  "failed requests")
    result["errors"] = errors
    return result
