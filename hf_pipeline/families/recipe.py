"""Split recipes: per-architecture data describing how a model cuts into pipeline stages.

A recipe is a TOML file in ``model_recipes/`` (one per family). It names, per ``config.model_type``,
the module paths of the embeddings, the repeated blocks, the final norms and the task heads, the
modules every stage needs a replica of, and the tied parameters. Generic code reads recipes; it
never branches on a model name. Adding an architecture of the same shape is a new TOML file.

Example:
    >>> recipe = get_recipe("llama")
    >>> recipe.stacks[0].blocks
    '{base}layers'
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.resources
import pathlib
from dataclasses import dataclass, field
from typing import Any

import tomllib

from ..errors import RecipeError
from .glue import GLUES, POOLS
from .losses import LOSSES
from .roles import ROLES

__all__ = [
    "HeadSpec", "Recipe", "RecipeError", "StackSpec", "get_recipe", "list_recipes", "load_recipe",
    "position_kind", "register_recipe",
]

# What a recipe may name, read from the registries that implement them (one list each).
KNOWN_GLUES = tuple(GLUES)
KNOWN_LOSSES = tuple(LOSSES)
KNOWN_POOLS = POOLS
# How a family encodes positions: a learned table (ends at max_position_embeddings); rotary, relative
# (T5), ALiBi (BLOOM) or sinusoidal (XGLM, which grows its table): no end.
POSITION_KINDS = ("learned", "rotary", "relative", "alibi", "sinusoidal")
# Glues that can run a block's two halves on different stages (``Glue.block_half``).
HALF_GLUES = tuple(name for name, cls in GLUES.items() if cls.runs_halves)


@dataclass(frozen=True, kw_only=True)
class StackSpec:
    """One repeated stack of blocks (a decoder-only model has one; T5 has encoder then decoder)."""

    name: str
    blocks: str  # path of the ModuleList of blocks, e.g. "{base}layers"
    embed: tuple[str, ...] = ()  # modules run before the stack's first block
    final: tuple[str, ...] = ()  # modules run after its last block
    every_stage: tuple[str, ...] = ()  # replicated on every stage that runs a block of this stack
    # Where a block may be cut between two stages: its children (names relative to the block) in
    # the half that runs first (attention) and the half that runs second (MLP). Empty: never cut.
    halves: tuple[tuple[str, ...], ...] = ()


@dataclass(frozen=True, kw_only=True)
class HeadSpec:
    """A task head, selected by the suffix of the model class name (``ForCausalLM``, ``Model`` ...)."""

    suffix: str
    modules: tuple[str, ...]
    outputs: tuple[str, ...]
    output_class: str
    loss: str | None = None
    pool: str | None = None
    # The last module's output holds one slice of its last dim per output, in order, as
    # transformers' question-answering heads split ``qa_outputs`` into start / end logits:
    # (B, T, len(outputs)) -> len(outputs) x (B, T).
    split_last_dim: bool = False
    # Inputs are (batch, num_choices, length), as transformers' multiple-choice heads take them:
    # the stages run the batch x num_choices rows flattened, the head's (B * C, 1) logits come back
    # as (B, C); microbatches hold whole examples (B rows).
    choices: bool = False
    # The stacks this head's model class has (T5EncoderModel: the encoder only); empty: all of them.
    stacks: tuple[str, ...] = ()


@dataclass(frozen=True, kw_only=True)
class Recipe:
    """A validated recipe. ``source`` is the file it came from, used in every error message."""

    source: str
    model_types: tuple[str, ...]
    glue: str
    flows: tuple[str, ...]
    stacks: tuple[StackSpec, ...]
    heads: dict[str, HeadSpec] = field(default_factory=dict)
    tied: tuple[tuple[str, ...], ...] = ()
    # How the model encodes positions (POSITION_KINDS): "learned" tables (GPT-2, BERT) end at
    # config.max_position_embeddings; "rotary" (LLaMA) and "relative" (T5) positions do not, and
    # transformers runs longer inputs for them.
    positions: str = "learned"
    # Per model_type where the recipe's families differ (a roles recipe serving many): model_type -> kind.
    positions_by_type: tuple[tuple[str, str], ...] = ()
    # model_type -> why its forward cannot run a continuous-batching op's rows packed in one sequence
    # (continuous_batching/packed_op.py; the ``[unpacked]`` table): those ops run in two forwards.
    unpacked: tuple[tuple[str, str], ...] = ()
    # Tensor parallelism for a family transformers gives no ``base_model_tp_plan`` (the ``[tp]`` table):
    # module pattern -> style, as transformers' plans name them; per module pattern the attributes its
    # forward reads that count heads or widths (divided by tp_size on each rank once it is sharded); the
    # config fields tp_size must divide besides the heads.
    tp_plan: tuple[tuple[str, str], ...] = ()
    tp_local: tuple[tuple[str, tuple[str, ...]], ...] = ()
    tp_divides: tuple[str, ...] = ()
    # Module paths name roles (``{blocks}``, ``{before}``, ... : :data:`~hf_pipeline.families.roles.ROLES`)
    # found on each model class (:func:`~hf_pipeline.families.roles.decoder_roles`) instead of fixed
    # names, and the tied parameters are the ones transformers itself ties in that class.
    roles: bool = False

    def match_head(self, class_name: str, base_class_name: str | None = None) -> HeadSpec | None:
        """The head for model class ``class_name``, or None.

        With the family's base model class (``BertModel``) the class must be its name stem plus a
        head suffix exactly (``Bert`` + ``ForMaskedLM``), so ``BertLMHeadModel`` or
        ``GPT2DoubleHeadsModel`` do not pass for the base model just because they end in ``Model``.
        A class that is its own base model (``T5EncoderModel`` has no inner base model) takes the
        longest head suffix ending in ``Model`` that ends its name (``EncoderModel`` before ``Model``).
        Without it, the longest suffix that ends ``class_name`` wins.
        """
        if base_class_name is not None and base_class_name == class_name and class_name.endswith("Model"):
            matches = [h for s, h in self.heads.items() if s.endswith("Model") and class_name.endswith(s)]
            return max(matches, key=lambda h: len(h.suffix)) if matches else None
        if self.roles and base_class_name is not None and base_class_name != class_name:
            # Roles recipes serve many families whose head classes need not repeat the base class's
            # stem (Gemma3ForCausalLM over Gemma3TextModel): the longest head suffix, never "Model".
            matches = [h for s, h in self.heads.items() if s != "Model" and class_name.endswith(s)]
            return max(matches, key=lambda h: len(h.suffix)) if matches else None
        if base_class_name is not None and base_class_name.endswith("Model"):
            stem = base_class_name[: -len("Model")]
            return next((h for s, h in self.heads.items() if class_name == stem + s), None)
        matches = [h for s, h in self.heads.items() if class_name.endswith(s)]
        return max(matches, key=lambda h: len(h.suffix)) if matches else None

    def head_for(self, class_name: str, base_class_name: str | None = None) -> HeadSpec:
        """:meth:`match_head`, raising when the recipe has no head for ``class_name``."""
        head = self.match_head(class_name, base_class_name)
        if head is None:
            raise RecipeError(
                f"{self.source}: no [heads.*] entry matches model class {class_name!r}; known heads: "
                f"{sorted(self.heads)}. Add a [heads.<ClassSuffix>] table to the recipe, or load with "
                f"split_method='auto' or 'trace' to let torch.export split it (forward and training only)."
            )
        return head

    def for_head(self, head: HeadSpec) -> "Recipe":
        """This recipe with only the stacks ``head``'s model class has (itself when the head names none)."""
        if not head.stacks:
            return self
        return dataclasses.replace(self, stacks=tuple(s for s in self.stacks if s.name in head.stacks))


def _expect(source: str, where: str, value: Any, kind: type | tuple[type, ...]) -> Any:
    if not isinstance(value, kind):
        names = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        raise RecipeError(f"{source}: field {where!r} must be a {names}, got {type(value).__name__} ({value!r})")
    return value


def _str_list(source: str, where: str, value: Any) -> tuple[str, ...]:
    _expect(source, where, value, list)
    for i, item in enumerate(value):
        _expect(source, f"{where}[{i}]", item, str)
    return tuple(value)


def _halves(source: str, where: str, value: Any, glue: str) -> tuple[tuple[str, ...], ...]:
    _expect(source, where, value, list)
    if not value:
        return ()
    if len(value) != 2:
        raise RecipeError(
            f"{source}: field {where!r} must list exactly two halves (attention, then MLP), got {len(value)}"
        )
    halves = tuple(_str_list(source, f"{where}[{i}]", h) for i, h in enumerate(value))
    if not all(halves):
        raise RecipeError(f"{source}: field {where!r}: each half must name at least one child module of the block")
    if set(halves[0]) & set(halves[1]):
        raise RecipeError(f"{source}: field {where!r}: {sorted(set(halves[0]) & set(halves[1]))} appear in both halves")
    if glue not in HALF_GLUES:
        raise RecipeError(
            f"{source}: field {where!r} declares block halves, but glue {glue!r} cannot run half a block; "
            f"glues that can: {list(HALF_GLUES)}"
        )
    return halves


# Fields of a recipe, by TOML section: the top level, each [[stacks]] table, each [heads.<Suffix>] table.
_TOP_FIELDS = {"model_types", "glue", "flows", "stacks", "heads", "tied", "positions", "tp", "roles", "unpacked"}
_TOP_REQUIRED = ("model_types", "glue", "stacks", "heads")
_STACK_FIELDS = {"name", "blocks", "embed", "final", "every_stage", "halves"}
_STACK_REQUIRED = ("name", "blocks")
_HEAD_FIELDS = {"modules", "outputs", "output_class", "loss", "pool", "split_last_dim", "choices", "stacks"}
_HEAD_REQUIRED = ("modules", "outputs", "output_class")
_TP_FIELDS = {"plan", "local", "divides"}


def _check_table(source: str, where: str, raw: dict[str, Any], allowed: set[str], required: tuple[str, ...]) -> None:
    """Refuse unknown and missing fields of one table of a recipe (``where``: its path in the TOML)."""
    extra = set(raw) - allowed
    if extra:
        raise RecipeError(f"{source}: unknown field(s) {sorted(extra)} in {where}")
    for key in required:
        if key not in raw:
            raise RecipeError(f"{source}: missing required field {where}.{key}")


def _parse_top(data: dict[str, Any], source: str) -> dict[str, Any]:
    """The top-level fields: model_types, glue, flows and positions."""
    for key in data:
        if key not in _TOP_FIELDS:
            raise RecipeError(f"{source}: unknown field {key!r}; allowed fields: {sorted(_TOP_FIELDS)}")
    for key in _TOP_REQUIRED:
        if key not in data:
            raise RecipeError(f"{source}: missing required field {key!r}")
    model_types = _str_list(source, "model_types", data["model_types"])
    if not model_types:
        raise RecipeError(f"{source}: field 'model_types' must name at least one config.model_type")
    glue = _expect(source, "glue", data["glue"], str)
    if glue not in KNOWN_GLUES:
        raise RecipeError(f"{source}: field 'glue' is {glue!r}; it must be one of {list(KNOWN_GLUES)}")
    flows = _str_list(source, "flows", data.get("flows", ["hidden_states"]))
    # "rotary", or a table: {default = "rotary", opt = "learned"}
    raw = _expect(source, "positions", data.get("positions", "learned"), (str, dict))
    kinds = dict(raw) if isinstance(raw, dict) else {"default": raw}
    for key, kind in kinds.items():
        where = "positions" if isinstance(raw, str) else f"positions.{key}"
        if _expect(source, where, kind, str) not in POSITION_KINDS:
            raise RecipeError(f"{source}: field {where!r} is {kind!r}; it must be one of {list(POSITION_KINDS)}")
        if key != "default" and key not in model_types:
            raise RecipeError(f"{source}: field {where!r} names a model_type the recipe does not claim")
    if "default" not in kinds:
        raise RecipeError(f"{source}: field 'positions' as a table needs a 'default' kind")
    roles = _expect(source, "roles", data.get("roles", False), bool)
    unpacked = _expect(source, "unpacked", data.get("unpacked", {}), dict)
    for key, why in unpacked.items():
        _expect(source, f"unpacked.{key}", why, str)
        if key not in model_types:
            raise RecipeError(f"{source}: field 'unpacked.{key}' names a model_type the recipe does not claim")
    return {
        "model_types": model_types, "glue": glue, "flows": flows, "positions": kinds.pop("default"),
        "positions_by_type": tuple(sorted(kinds.items())), "roles": roles, "unpacked": tuple(sorted(unpacked.items())),
    }


def _parse_stack(source: str, index: int, raw: Any, glue: str) -> StackSpec:
    """One ``[[stacks]]`` table."""
    where = f"stacks[{index}]"
    _expect(source, where, raw, dict)
    _check_table(source, where, raw, _STACK_FIELDS, _STACK_REQUIRED)
    return StackSpec(
        name=_expect(source, f"{where}.name", raw["name"], str),
        blocks=_expect(source, f"{where}.blocks", raw["blocks"], str),
        embed=_str_list(source, f"{where}.embed", raw.get("embed", [])),
        final=_str_list(source, f"{where}.final", raw.get("final", [])),
        every_stage=_str_list(source, f"{where}.every_stage", raw.get("every_stage", [])),
        halves=_halves(source, f"{where}.halves", raw.get("halves", []), glue),
    )


def _parse_head(source: str, suffix: str, raw: Any, stack_names: list[str]) -> HeadSpec:
    """One ``[heads.<ClassSuffix>]`` table (``stack_names``: the recipe's stacks, which it may narrow to)."""
    where = f"heads.{suffix}"
    _expect(source, where, raw, dict)
    _check_table(source, where, raw, _HEAD_FIELDS, _HEAD_REQUIRED)
    loss = raw.get("loss")
    if loss is not None and loss not in KNOWN_LOSSES:
        raise RecipeError(f"{source}: field {where}.loss is {loss!r}; it must be one of {list(KNOWN_LOSSES)}")
    pool = raw.get("pool")
    if pool is not None and pool not in KNOWN_POOLS:
        raise RecipeError(f"{source}: field {where}.pool is {pool!r}; it must be one of {list(KNOWN_POOLS)}")
    outputs = _str_list(source, f"{where}.outputs", raw["outputs"])
    if not outputs:
        raise RecipeError(f"{source}: field {where}.outputs must name at least one output")
    split_last_dim = _expect(source, f"{where}.split_last_dim", raw.get("split_last_dim", False), bool)
    if split_last_dim and len(outputs) < 2:
        raise RecipeError(
            f"{source}: field {where}.split_last_dim splits the head's last dim into its outputs, so "
            f"{where}.outputs must name at least two (e.g. [\"start_logits\", \"end_logits\"]), got {list(outputs)}"
        )
    choices = _expect(source, f"{where}.choices", raw.get("choices", False), bool)
    head_stacks = _str_list(source, f"{where}.stacks", raw.get("stacks", []))
    unknown = sorted(set(head_stacks) - set(stack_names))
    if unknown:
        raise RecipeError(
            f"{source}: field {where}.stacks names {unknown}, which are not stacks of this recipe; "
            f"its stacks: {stack_names}"
        )
    return HeadSpec(
        suffix=suffix,
        modules=_str_list(source, f"{where}.modules", raw["modules"]),
        outputs=outputs,
        output_class=_expect(source, f"{where}.output_class", raw["output_class"], str),
        loss=loss,
        pool=pool,
        split_last_dim=split_last_dim,
        choices=choices,
        stacks=head_stacks,
    )


def _parse_tied(data: dict[str, Any], source: str) -> tuple[tuple[str, ...], ...]:
    """The ``[tied]`` table: groups of parameter names that are one tensor."""
    tied_raw = _expect(source, "tied", data.get("tied", {}), dict)
    groups = tied_raw.get("groups", [])
    _expect(source, "tied.groups", groups, list)
    return tuple(_str_list(source, f"tied.groups[{i}]", g) for i, g in enumerate(groups))


def _parse_tp(data: dict[str, Any], source: str) -> dict[str, Any]:
    """The ``[tp]`` table: ``plan`` (module pattern -> style), ``local`` (module pattern -> attributes
    divided by tp_size) and ``divides`` (config fields tp_size must divide). Styles are checked where
    the plan is used (:func:`hf_pipeline.planning.tp_plan.tp_plan`), with the caller's plans."""
    raw = _expect(source, "tp", data.get("tp", {}), dict)
    _check_table(source, "tp", raw, _TP_FIELDS, ())
    plan = _expect(source, "tp.plan", raw.get("plan", {}), dict)
    for key, style in plan.items():
        _expect(source, f"tp.plan.{key!r}", style, str)
    local = _expect(source, "tp.local", raw.get("local", {}), dict)
    return {
        "tp_plan": tuple(plan.items()),
        "tp_local": tuple((k, _str_list(source, f"tp.local.{k!r}", v)) for k, v in local.items()),
        "tp_divides": _str_list(source, "tp.divides", raw.get("divides", [])),
    }


def _parse(data: dict[str, Any], source: str) -> Recipe:
    top = _parse_top(data, source)
    raw_stacks = _expect(source, "stacks", data["stacks"], list)
    stacks = tuple(_parse_stack(source, i, raw, top["glue"]) for i, raw in enumerate(raw_stacks))
    if not stacks:
        raise RecipeError(f"{source}: field 'stacks' must list at least one stack of blocks")
    stack_names = [st.name for st in stacks]
    heads = {
        suffix: _parse_head(source, suffix, raw, stack_names)
        for suffix, raw in _expect(source, "heads", data["heads"], dict).items()
    }
    recipe = Recipe(
        source=source, stacks=stacks, heads=heads, tied=_parse_tied(data, source), **top, **_parse_tp(data, source)
    )
    _check_roles(recipe)
    return recipe


def _check_roles(recipe: Recipe) -> None:
    """Role placeholders only in a ``roles = true`` recipe, and only as whole paths."""
    paths = [p for st in recipe.stacks for p in (st.blocks, *st.embed, *st.final, *st.every_stage)]
    paths += [p for h in recipe.heads.values() for p in h.modules]
    for path in paths:
        named = [r for r in ROLES if r in path]
        if named and not recipe.roles:
            raise RecipeError(
                f"{recipe.source}: module path {path!r} names a role {named}; set roles = true to use roles"
            )
        if named and path not in ROLES:
            raise RecipeError(
                f"{recipe.source}: module path {path!r}: a role stands alone as a path (one of {list(ROLES)})"
            )


def load_recipe(path: str | pathlib.Path) -> Recipe:
    """Read and validate one recipe file.

    Args:
        path: a ``.toml`` recipe.
    Returns:
        The validated :class:`Recipe`.
    Raises:
        RecipeError: naming the file and the offending field.
    """
    path = pathlib.Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise RecipeError(f"{path}: not valid TOML ({e})") from None
    return _parse(data, str(path))


_EXTRA: dict[str, Recipe] = {}


def register_recipe(path_or_recipe: str | pathlib.Path | Recipe) -> Recipe:
    """Register a recipe from outside ``model_recipes/`` (it wins over a built-in one of the same model_type)."""
    recipe = path_or_recipe if isinstance(path_or_recipe, Recipe) else load_recipe(path_or_recipe)
    for mt in recipe.model_types:
        _EXTRA[mt] = recipe
    return recipe


@functools.cache
def _builtin() -> dict[str, Recipe]:
    registry: dict[str, Recipe] = {}
    root = importlib.resources.files("model_recipes")
    for entry in sorted(root.iterdir(), key=lambda e: e.name):
        if not entry.name.endswith(".toml"):
            continue
        with importlib.resources.as_file(entry) as path:
            recipe = load_recipe(path)
        for mt in recipe.model_types:
            if mt in registry:
                raise RecipeError(f"{recipe.source}: model_type {mt!r} is already claimed by {registry[mt].source}")
            registry[mt] = recipe
    return registry


def list_recipes() -> dict[str, Recipe]:
    """All known recipes by model_type (built-in plus registered)."""
    return {**_builtin(), **_EXTRA}


def get_recipe(model_type: str) -> Recipe:
    """The recipe for ``config.model_type``.

    Raises:
        RecipeError: listing the supported model types and how to add one.
    """
    known = list_recipes()
    if model_type not in known:
        raise RecipeError(
            f"no pipeline recipe for model_type {model_type!r}. Supported: {sorted(known)}. A standard transformers "
            f"decoder (a base model holding a ModuleList of config.num_hidden_layers layers) needs only a copy of "
            f"model_recipes/decoder.toml naming {model_type!r} in model_types (without the other types' [positions] "
            f"and [unpacked] entries), passed to "
            f"hf_pipeline.register_recipe(path); another layout, a TOML file like model_recipes/llama.toml naming its "
            f"embeddings, blocks, final modules and heads; or load with split_method='trace' to let torch.export "
            f"split it (forward and training only)."
        )
    return known[model_type]


def position_kind(config) -> str:
    """How ``config``'s model encodes positions (its recipe's ``positions``); ``"learned"`` without a recipe.

    Only ``"learned"`` tables limit the sequence length to ``config.max_position_embeddings``:
    transformers runs rotary (LLaMA, with or without rope scaling), relative (T5), ALiBi (BLOOM) and
    sinusoidal (XGLM) models on longer inputs.
    """
    model_type = getattr(config, "model_type", None)
    recipe = list_recipes().get(model_type)
    return dict(recipe.positions_by_type).get(model_type, recipe.positions) if recipe is not None else "learned"

