"""The same pipelines without hf_pipeline: transformers' layers under torch's own pipelining and P2P.

hf_pipeline's step (or decode ring) against one of these, on the same split and the same seconds
of the machine, is what hf_pipeline adds (or saves) over torch's own runtime.
"""

from __future__ import annotations

import copy
import re
import time

from benchmarks.timing import sync

__all__ = ["layer_indices", "stage_part", "torch_pipeline", "torch_ring_step_seconds"]


def layer_indices(modules) -> list[int]:
    """The LLaMA decoder layers (``model.layers.<i>`` or a module inside one) among a stage's module names,
    ascending."""
    found = (re.fullmatch(r"model\.layers\.(\d+)(\..*)?", m) for m in modules)
    return sorted({int(x.group(1)) for x in found if x})


def _stage_module(reference, spec):
    """A plain module over copies of ``reference``'s parts that the stage ``spec`` holds: the embedding
    on the first stage, its decoder layers, the rotary embedding, the final norm and LM head on the last."""
    import torch
    from torch import nn

    class Stage(nn.Module):
        def __init__(self):
            super().__init__()
            if spec.halves:
                raise ValueError(
                    f"stage {spec.index} splits a layer ({dict(spec.halves)}): the torch-only pipeline takes whole "
                    "layers")
            base = reference.model
            self.embed = copy.deepcopy(base.embed_tokens) if spec.is_first else None
            self.layers = nn.ModuleList(copy.deepcopy(base.layers[i]) for i in layer_indices(spec.modules))
            self.rotary = copy.deepcopy(base.rotary_emb)
            self.norm = copy.deepcopy(base.norm) if spec.is_last else None
            self.head = copy.deepcopy(reference.lm_head) if spec.is_last else None

        def forward(self, x):
            h = self.embed(x) if self.embed is not None else x
            positions = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
            rotary = self.rotary(h, positions)
            for layer in self.layers:  # no mask: transformers' SDPA attention is causal without one
                h = layer(h, position_ids=positions, position_embeddings=rotary)
            return self.head(self.norm(h)) if self.head is not None else h

    return Stage()


def _loss(logits, labels):
    from torch import nn

    return nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten())


def torch_pipeline(reference, plan, schedule: str, n_microbatches: int):
    """The pipeline of ``plan`` built from transformers' layers and torch's pipelining alone, no
    hf_pipeline: each of this rank's stages is a plain module over copies of ``reference``'s
    embedding, decoder layers, rotary embedding, final norm and LM head; torch's ``PipelineStage``;
    the schedule's torch class, as torch's documentation shows it (for the zero-bubble schedules its
    generic split backward). Returns ``step(batch) -> (seconds, loss)``: one forward + backward of the
    batch, timed on this rank (ranks start together), gradients cleared; the loss (the microbatches'
    mean token cross-entropy) on every rank.

    hf_pipeline's step against this one, on the same split and the same seconds of the machine, is
    what hf_pipeline adds (or saves) over torch's own runtime: its stage modules, its zero-bubble
    weight pass, the step's own work (the ranks' agreement on the batch, the loss's reduction)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage

    from hf_pipeline.planning.schedules import get_schedule

    rank = dist.get_rank()
    mine = [s for s in plan.stages if s.rank == rank]
    stages = [PipelineStage(_stage_module(reference, s), s.index, plan.num_stages, torch.device("cpu")) for s in mine]
    spec = get_schedule(schedule)
    runner = spec.cls(stages if spec.multi else stages[0], n_microbatches=n_microbatches, loss_fn=_loss)
    first, last = any(s.is_first for s in mine), any(s.is_last for s in mine)

    def step(batch: dict) -> tuple[float, float]:
        losses: list = []
        sync()
        t = time.perf_counter()
        inputs = (batch["input_ids"],) if first else ()
        runner.step(*inputs, **({"target": batch["labels"], "losses": losses} if last else {}))
        took = time.perf_counter() - t
        for stage in stages:
            stage.submod.zero_grad(set_to_none=True)
        loss = torch.tensor([float(torch.stack(losses).mean()) if losses else 0.0])
        dist.all_reduce(loss)  # one rank holds the last stage
        return took, float(loss)

    return step


def stage_part(model, plan, rank: int):
    """This rank's share of the pipelined model's split, built from transformers' own ``model``: its
    layers (renumbered, as a transformers cache counts them) under the LM head when the rank holds
    it, else under the base model (the embedding lookup and final norm it adds cost next to nothing).
    Returns the part and what it holds, in words."""
    mods = [m for st in plan.stages if st.rank == rank for m in st.modules]
    layers = layer_indices(mods)
    head = "lm_head" in mods
    part = copy.deepcopy(model)
    part.model.layers = part.model.layers[layers[0]: layers[-1] + 1]
    part.config.num_hidden_layers = len(part.model.layers)
    for i, layer in enumerate(part.model.layers):
        layer.self_attn.layer_idx = i
    what = f"layers {layers[0]}-{layers[-1]}" + (" + LM head" if head else "")
    return (part if head else part.model), what


def torch_ring_step_seconds(model, rows: int, past: int, m: int, steps: int, *, ring: bool) -> float:
    """Seconds per token of a decode ring built from transformers' layers and torch's P2P alone.

    Every rank runs ``model`` (its share of the layers) on ``m`` microbatches of ``rows`` rows per
    token. ``ring=True``: as hf_pipeline's ring, rank k waits for microbatch i from rank k-1 (rank 0:
    from the last rank, a step later), runs it, and sends it on with ``isend``; receives are posted
    ahead. ``ring=False``: the same steps back to back, no messages.
    """
    import torch
    import torch.distributed as dist

    r, world = dist.get_rank(), dist.get_world_size()
    nxt, prev = (r + 1) % world, (r - 1) % world
    ids = torch.randint(3, model.config.vocab_size, (rows, past), generator=torch.Generator().manual_seed(3))
    hidden = model.config.hidden_size
    with torch.no_grad():
        caches = [model(input_ids=ids, use_cache=True).past_key_values for _ in range(m)]
        token = ids[:, -1:]
        sbuf = [torch.zeros(rows, 1, hidden + 1) for _ in range(m)]
        rbuf = [torch.zeros(rows, 1, hidden + 1) for _ in range(m)]
        recvs = [dist.irecv(rbuf[i], prev) if ring and r > 0 else None for i in range(m)]
        sends = []
        dist.barrier()
        start = time.perf_counter()
        for t in range(steps):
            for i in range(m):
                if ring and (r > 0 or t > 0):
                    recvs[i].wait()
                model(input_ids=token, cache=caches[i], use_cache=True)
                caches[i].crop(-1)
                if not ring:
                    continue
                last_send = r == world - 1 and t == steps - 1  # the last token goes nowhere
                if not last_send:
                    sends.append(dist.isend(sbuf[i], nxt))
                if t < steps - 1:  # the next message for microbatch i: step t + 1's
                    recvs[i] = dist.irecv(rbuf[i], prev)
        for w in sends:
            w.wait()
        took = time.perf_counter() - start
    return took / steps
