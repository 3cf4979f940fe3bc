"""The traced stages' graphs: how each is wired to its neighbours, rewritten and run.

:func:`stage_flows` reads from torch's split graph where every stage's arguments come from and
what it must pass on; :func:`retarget_devices` and :func:`defer_linears` rewrite a freshly traced
graph for the stage's device and the zero-bubble weight pass; :class:`StageRunner` runs one graph.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any

import torch
from torch import fx, nn

from ..compat import fx_graph_of, pytree
from ..errors import TraceError
from ..runtime import weight_pass

__all__ = ["StageFlow", "StageRunner", "defer_linears", "retarget_devices", "rewrite_graphs", "stage_flows"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class StageFlow:
    """How one traced stage is wired: where each graph argument comes from, what it passes on."""

    call: str  # node name of the stage's call in the split graph
    args: tuple[tuple[str, str], ...]  # ("input", model input name) or ("value", node name)
    getitems: tuple[tuple[str, int], ...]  # (node name, index) of the stage's outputs used later
    carry_in: tuple[str, ...]  # node names received from the previous stage, in order
    carry_out: tuple[str, ...]  # node names sent to the next stage (empty on the last)
    outputs: tuple[tuple[str, str], ...] | None  # last stage: the model output leaves


def stage_flows(split_gm: fx.GraphModule, num_stages: int) -> list[StageFlow]:
    """Per-stage wiring from the split graph.

    Note: the traced graph may feed a value from stage 0 straight to stage 2 (an attention mask,
    rotary cos/sin), but torch 2.13's runtime only moves tensors between adjacent stages, so such
    values are carried through the stages in between. Model inputs are not carried: every stage
    gets them as keyword arguments.
    """
    calls: list[fx.Node] = []
    getitems: dict[str, list[tuple[str, int]]] = {}
    producer: dict[str, int] = {}
    consumers: dict[str, set[int]] = {}
    order: dict[str, int] = {}
    out_refs: list[tuple[str, str]] = []

    def ref(node: Any, user: int) -> tuple[str, str]:
        if not isinstance(node, fx.Node):
            raise TraceError(
                f"the split graph passes a constant {node!r} between stages; only tensors can cross stages"
            )
        if node.op == "placeholder":
            return ("input", node.target)
        consumers.setdefault(node.name, set()).add(user)
        return ("value", node.name)

    for i, node in enumerate(split_gm.graph.nodes):
        order[node.name] = i
        if node.op == "call_module":
            k = len(calls)
            if node.kwargs:
                raise TraceError(f"stage {k} of the split graph takes keyword arguments {list(node.kwargs)}")
            calls.append(node)
            producer[node.name] = k
        elif node.op == "call_function" and node.target is operator.getitem:
            src, idx = node.args
            getitems.setdefault(src.name, []).append((node.name, idx))
            producer[node.name] = producer[src.name]
        elif node.op == "output":
            for leaf in pytree.tree_leaves(node.args[0]):
                out_refs.append(ref(leaf, num_stages))
        elif node.op != "placeholder":
            raise TraceError(f"unexpected node {node.format_node()} in the split graph")
    if len(calls) != num_stages:
        raise TraceError(
            f"the trace produced {len(calls)} stage(s), not {num_stages}: a split point was never reached in forward. "
            f"Pass split= with blocks that forward runs"
        )
    args = [tuple(ref(a, k) for a in call.args) for k, call in enumerate(calls)]
    flows = []
    carry: tuple[str, ...] = ()
    for k, call in enumerate(calls):
        last = k == num_stages - 1
        live = sorted(
            (v for v, users in consumers.items() if producer[v] <= k and max(users) > k), key=order.__getitem__
        )
        flows.append(
            StageFlow(
                call=call.name,
                args=args[k],
                getitems=tuple(getitems.get(call.name, ())),
                carry_in=carry,
                carry_out=() if last else tuple(live),
                outputs=tuple(out_refs) if last else None,
            )
        )
        carry = () if last else tuple(live)
    return flows


def rewrite_graphs(root: nn.Module, rewrite) -> None:
    """Call ``rewrite(graph)`` on every fx graph under ``root`` (unflattened stage modules keep one
    each); recompile the modules whose graph it changed (it returns True then)."""
    for mod in root.modules():
        graph = fx_graph_of(mod)
        if isinstance(graph, fx.Graph) and rewrite(graph):
            for gm in (mod, mod.__dict__.get("graph_module")):
                if isinstance(gm, fx.GraphModule):
                    gm.recompile()


def retarget_devices(root: nn.Module, device: torch.device) -> None:
    """Point every device the trace burned into the graphs (``arange(device=...)``, ``.to(w.device)``) at ``device``.

    Tracing runs on meta weights with CPU inputs, so graphs name ``meta`` and ``cpu``. torch's own
    fix (``Pipe.build_stage``) rewrites only ``device=`` keyword arguments; ``aten.to.device`` takes
    the device positionally, so every ``torch.device`` argument is rewritten here.
    """

    def retarget(graph: fx.Graph) -> bool:
        changed = False

        def fix(a: Any) -> Any:
            nonlocal changed
            if isinstance(a, torch.device) and a != device:
                changed = True
                return device
            return a

        for node in graph.nodes:
            node.args, node.kwargs = fx.node.map_aggregate(node.args, fix), fx.node.map_aggregate(node.kwargs, fix)
        return changed

    rewrite_graphs(root, retarget)


def defer_linears(root: nn.Module) -> None:
    """Point the graphs' ``aten.linear`` calls at ``weight_pass.linear``: in zero-bubble steps it
    defers the weight gradient to W, as recipe stages' linear layers do."""

    def route(graph: fx.Graph) -> bool:
        nodes = [n for n in graph.nodes if n.op == "call_function" and n.target is torch.ops.aten.linear.default]
        for node in nodes:
            node.target = weight_pass.linear
        return bool(nodes)

    rewrite_graphs(root, route)


class StageRunner(nn.Module):
    """Runs one traced stage graph: picks its arguments from received tensors and model inputs."""

    def __init__(self, graph: nn.Module, flow: StageFlow, index: int):
        super().__init__()
        self.graph = graph
        self.flow = flow
        self.index = index

    def forward(self, *received: torch.Tensor, **inputs: Any):
        flow = self.flow
        if len(received) != len(flow.carry_in):
            raise TraceError(
                f"stage {self.index} expects {len(flow.carry_in)} tensor(s) from the previous stage, got "
                f"{len(received)}"
            )
        env = dict(zip(flow.carry_in, received))
        args = [inputs[name] if kind == "input" else env[name] for kind, name in flow.args]
        raw = self.graph(*args)
        env[flow.call] = raw
        for name, idx in flow.getitems:
            env[name] = raw[idx]
        if flow.outputs is not None:
            leaves = tuple(inputs[name] if kind == "input" else env[name] for kind, name in flow.outputs)
            return leaves[0] if len(leaves) == 1 else leaves
        out = tuple(env[name] for name in flow.carry_out)
        for name, t in zip(flow.carry_out, out):
            if not isinstance(t, torch.Tensor):
                raise TraceError(
                    f"stage {self.index} would send {name} = {t!r} to the next stage; only tensors can cross stages"
                )
        # A traced value may be a view (T5's position bias is an expanded slice); send and receive
        # buffers must be dense, and .contiguous() is a no-op (same tensor, same autograd) when it is.
        return tuple(t.contiguous() for t in out)
