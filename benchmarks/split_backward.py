"""What a zero-bubble schedule's split backward costs on this machine, apart from any pipeline."""

from __future__ import annotations

import time

from benchmarks.timing import median

__all__ = ["split_backward_seconds"]

_TIMES = ("forward", "backward", "input", "weight", "torch_input", "torch_weight")


def _layers_input(model, sizes: dict):
    """One rank's share of ``model``'s decoder layers, and a microbatch for them: hidden states, their
    gradient, position ids and the rotary embedding (transformers' own)."""
    import torch

    layers = model.model.layers[: max(1, sizes["layers"] // sizes["world"])]
    rows = max(1, sizes["batch"] // sizes["n_microbatches"])
    gen = torch.Generator().manual_seed(5)
    x0 = torch.randn(rows, sizes["seq"], sizes["hidden"], generator=gen)
    grad = torch.randn(rows, sizes["seq"], sizes["hidden"], generator=gen)
    positions = torch.arange(sizes["seq"])[None].expand(rows, -1)
    rope = tuple(t.detach() for t in model.model.rotary_emb(x0, positions))
    return layers, rows, x0, grad, positions, rope


def split_backward_seconds(model, sizes: dict) -> dict[str, float]:
    """One rank's share of the decoder layers (transformers' own) on one pipeline microbatch: the
    seconds of its forward, its full backward, and a zero-bubble schedule's split backward, input
    pass (I) then weight pass (W), two ways: hf_pipeline's (``weight_pass.py``: I is the full
    backward with the linears' weight matmuls left out, W those matmuls) and torch's generic one
    (``stage_backward_input`` / ``stage_backward_weight``). Alternating, medians. What the split
    costs on this machine, apart from any pipeline."""
    import torch
    from torch.distributed.pipelining import _backward as torch_backward  # torch's split; no public name

    from hf_pipeline.runtime import weight_pass

    layers, rows, x0, grad, positions, rope = _layers_input(model, sizes)
    weight_pass.install(layers)
    params = [p for layer in layers for p in layer.parameters()]

    def forward():
        x = x0.clone().requires_grad_()
        h = x
        for layer in layers:
            h = layer(h, position_embeddings=rope, attention_mask=None, position_ids=positions)
            h = h[0] if isinstance(h, tuple) else h
        return x, h

    times: dict[str, list[float]] = {k: [] for k in _TIMES}
    for _ in range(6 if sizes["train_reps"] > 1 else 2):
        t = time.perf_counter()
        x, h = forward()
        times["forward"].append(time.perf_counter() - t)
        t = time.perf_counter()
        torch.autograd.backward(h, grad, inputs=[x, *params])
        times["backward"].append(time.perf_counter() - t)
        with weight_pass.deferring():
            x, h = forward()
            t = time.perf_counter()
            with weight_pass.capturing():
                torch.autograd.backward(h, grad, inputs=[x, *params])
            w = weight_pass.take()
            t1 = time.perf_counter()
            w()
            times["input"].append(t1 - t)
            times["weight"].append(time.perf_counter() - t1)
        x, h = forward()
        t = time.perf_counter()
        _, groups = torch_backward.stage_backward_input([h], [grad], [x], iter(params))
        t1 = time.perf_counter()
        torch_backward.stage_backward_weight(iter(params), groups)
        times["torch_input"].append(t1 - t)
        times["torch_weight"].append(time.perf_counter() - t1)
        for p in params:
            p.grad = None
    got = {k: median(v[1:]) for k, v in times.items()}
    got["layers"], got["rows"] = len(layers), rows
    return got
