"""Tier 1: recipes are data; every file parses, resolves against its models, and bad ones fail clearly."""

import pathlib

import pytest
import tiny
import torch

from hf_pipeline.families.recipe import RecipeError, get_recipe, list_recipes, load_recipe, register_recipe
from hf_pipeline.loading.stages import meta_model
from hf_pipeline.planning.resolve import resolve_recipe

RECIPE_DIR = pathlib.Path(__file__).resolve().parents[2] / "model_recipes"
RECIPE_FILES = sorted(RECIPE_DIR.glob("*.toml"))

# Every head class each recipe declares, with a config that builds it.
HEADS = {
    "llama": ["AutoModel", "AutoModelForCausalLM", "AutoModelForSequenceClassification"],
    "mistral": ["AutoModel", "AutoModelForCausalLM"],
    "qwen2": ["AutoModel", "AutoModelForCausalLM"],
    "gpt2": ["AutoModel", "AutoModelForCausalLM"],
    "bert": ["AutoModel", "AutoModelForMaskedLM", "AutoModelForSequenceClassification"],
    "t5": ["AutoModelForSeq2SeqLM"],
}


def test_four_families_and_their_model_types():
    assert {p.stem for p in RECIPE_FILES} >= {"bert", "gpt2", "t5", "llama"}
    assert {"bert", "gpt2", "t5", "llama", "mistral", "qwen2"} <= set(list_recipes())
    assert get_recipe("mistral") is get_recipe("llama")


@pytest.mark.parametrize("path", RECIPE_FILES, ids=lambda p: p.stem)
def test_every_recipe_file_is_valid(path):
    recipe = load_recipe(path)
    assert recipe.model_types and recipe.stacks and recipe.heads
    for stack in recipe.stacks:
        assert stack.blocks


@pytest.mark.parametrize("model_type,auto", [(mt, a) for mt, autos in HEADS.items() for a in autos])
def test_recipe_resolves_against_the_real_model(model_type, auto):
    model = meta_model(tiny.config_for(model_type), auto)
    resolved = resolve_recipe(model, get_recipe(model_type))
    # every block, embedding, final and head module exists and every parameter is owned by something
    owned = set()
    for stack in resolved.stacks:
        owned.update(stack.blocks + stack.embed + stack.final)
    owned.update(resolved.head.modules)
    names = [n for n, _ in model.named_parameters()]
    unowned = [n for n in names if not any(n.startswith(m + ".") for m in owned)]
    tied_away = {n for g in resolved.tied for n in g}
    assert [n for n in unowned if n not in tied_away] == []


def test_tied_groups_follow_the_config():
    untied = resolve_recipe(meta_model(tiny.config_for("llama"), "AutoModelForCausalLM"), get_recipe("llama"))
    tied = resolve_recipe(meta_model(tiny.config_for("llama-tied"), "AutoModelForCausalLM"), get_recipe("llama"))
    assert untied.tied == ()
    assert tied.tied == (("model.embed_tokens.weight", "lm_head.weight"),)


def test_unknown_model_type_lists_supported_and_says_how_to_add():
    with pytest.raises(RecipeError) as e:
        get_recipe("mamba")
    msg = str(e.value)
    assert "mamba" in msg and "llama" in msg and "t5" in msg and "register_recipe" in msg


BAD = {
    "not toml": ("model_types = [", "not valid TOML"),
    "missing field": (
        'model_types = ["x"]\nglue = "llama"\n[heads.Model]\nmodules=[]\noutputs=["a"]\noutput_class="A"\n',
        "'stacks'",
    ),
    "bad glue": (
        'model_types = ["x"]\nglue = "nope"\nstacks=[{name="a", blocks="b"}]\n'
        '[heads.Model]\nmodules=[]\noutputs=["a"]\noutput_class="A"\n',
        "'glue'",
    ),
    "wrong type": ('model_types = "x"\nglue = "llama"\nstacks=[]\nheads={}\n', "'model_types'"),
    "unknown field": (
        'model_types = ["x"]\nglue = "llama"\nstacks=[{name="a", blocks="b"}]\nheads={}\nfoo=1\n',
        "'foo'",
    ),
    "stack field": ('model_types = ["x"]\nglue = "llama"\nstacks=[{name="a"}]\nheads={}\n', "stacks[0].blocks"),
    "three halves": (
        'model_types = ["x"]\nglue = "llama"\n'
        'stacks=[{name="a", blocks="b", halves=[["x"], ["y"], ["z"]]}]\nheads={}\n',
        "exactly two halves",
    ),
    "overlapping halves": (
        'model_types = ["x"]\nglue = "llama"\nstacks=[{name="a", blocks="b", halves=[["x", "y"], ["y"]]}]\nheads={}\n',
        "both halves",
    ),
    "halves without a glue for them": (
        'model_types = ["x"]\nglue = "t5"\nstacks=[{name="a", blocks="b", halves=[["x"], ["y"]]}]\nheads={}\n',
        "cannot run half a block",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_malformed_recipe_names_file_and_field(tmp_path, case):
    text, field = BAD[case]
    path = tmp_path / "broken.toml"
    path.write_text(text)
    with pytest.raises(RecipeError) as e:
        load_recipe(path)
    assert "broken.toml" in str(e.value) and field in str(e.value)


def test_recipe_naming_a_missing_module_names_the_field(tmp_path):
    text = (RECIPE_DIR / "llama.toml").read_text().replace('final = ["{base}norm"]', 'final = ["{base}final_norm"]')
    path = tmp_path / "llama_typo.toml"
    path.write_text(text)
    recipe = load_recipe(path)
    with pytest.raises(RecipeError) as e:
        resolve_recipe(meta_model(tiny.config_for("llama"), "AutoModelForCausalLM"), recipe)
    msg = str(e.value)
    assert "llama_typo.toml" in msg and "stacks[0].final" in msg and "model.final_norm" in msg


def test_a_new_architecture_is_a_new_recipe_file(tmp_path):
    # VaultGemma, which no built-in recipe claims, through a copy of the generic decoder recipe
    # registered from outside the package naming it: the roles are found on its classes and each
    # stage runs its own forward. Before registering, "auto" falls back to the tracer and "recipe"
    # is refused; after, the recipe's stages run and equal transformers.
    import re

    import transformers
    from decoders import COMMON

    import hf_pipeline
    from hf_pipeline.model import TracedPipelinedModel
    from hf_pipeline.planning.options import PipelineOptions

    config = transformers.VaultGemmaConfig(**{**COMMON, "head_dim": 8})
    assert config.model_type not in list_recipes(), "vaultgemma has a built-in recipe now: pick a family without one"
    torch.manual_seed(0)
    checkpoint = tmp_path / "vaultgemma"
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(checkpoint, max_shard_size="40KB")
    assert PipelineOptions.resolve(config, 1, split_method="auto").traced
    with pytest.raises(RecipeError, match="vaultgemma.*register_recipe"):
        hf_pipeline.AutoModelForCausalLM.from_pretrained(checkpoint, pipeline=True, device="cpu", split_method="recipe")

    text = (RECIPE_DIR / "decoder.toml").read_text()
    text, n = re.subn(r"^model_types = \[[^\]]*\]", 'model_types = ["vaultgemma"]', text, count=1, flags=re.M)
    # per-type entries of other families ([positions], [unpacked])
    text = re.sub(r"^(opt|gpt_bigcode|xglm|bloom|falcon|deepseek_v3) = .*$", "", text, flags=re.M)
    assert n == 1, "decoder.toml has no model_types line to replace"
    path = tmp_path / "my_vaultgemma.toml"
    path.write_text(text)
    recipe = register_recipe(path)
    try:
        assert get_recipe("vaultgemma") is recipe
        resolve_recipe(meta_model(config, "AutoModelForCausalLM"), recipe)
        assert not PipelineOptions.resolve(config, 1, split_method="auto").traced
        # World size 1, two stages of two layers each, run one after another by the schedule.
        model = hf_pipeline.AutoModelForCausalLM.from_pretrained(
            checkpoint, pipeline=True, device="cpu", schedule="interleaved-1f1b", virtual_stages=2, n_microbatches=2,
        )
        assert not isinstance(model, TracedPipelinedModel)
        assert len(model.stages) == 2
        ref = tiny.reference(checkpoint, "AutoModelForCausalLM")
        assert type(ref) is transformers.VaultGemmaForCausalLM
        names = sorted(n for s in model.stages for n, _ in s.named_parameters())
        assert names == sorted(n for n, _ in ref.named_parameters())
        inputs = tiny.sample_inputs("llama")
        with torch.no_grad():
            got, want = model(**inputs).logits, ref(**inputs).logits
        assert got.shape == want.shape
        diff = (got - want).abs().max().item()
        # fp32, same kernels, same order within each row: rounding only (~1e-7 at |logits| ~0.5); a
        # missing embedding scale or a wrong mask moves them by 1e-2 or more
        assert diff <= 1e-5, f"pipelined VaultGemma logits differ from transformers by {diff:.3g}"
    finally:
        from hf_pipeline.families import recipe as mod

        mod._EXTRA.clear()


def test_halves_naming_a_missing_child_name_the_block(tmp_path):
    text = (
        (RECIPE_DIR / "llama.toml")
        .read_text()
        .replace('["post_attention_layernorm", "mlp"]', '["post_attention_layernorm", "feed_forward"]')
    )
    path = tmp_path / "llama_halves.toml"
    path.write_text(text)
    with pytest.raises(RecipeError) as e:
        resolve_recipe(meta_model(tiny.config_for("llama"), "AutoModelForCausalLM"), load_recipe(path))
    msg = str(e.value)
    assert (
        "llama_halves.toml" in msg and "stacks[0].halves" in msg and "feed_forward" in msg and "model.layers.0" in msg
    )
