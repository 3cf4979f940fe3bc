"""Tiny configs of every decoder architecture the generic decoder recipe claims (``model_recipes/decoder*.toml``).

Each is transformers' own config class for the ``model_type``, at 4 layers of width 32 and a 96-token
vocabulary, with what the family needs to be small and to exercise what its forward does around the
layers: sliding and full layers mixed (Gemma 2/3, Cohere 2, gpt-oss, Qwen3, OLMo 3, EXAONE 4), a window
shorter than the tests' sequences, ALiBi (BLOOM, Falcon with ``alibi=True``), partial rotary (Phi,
StableLM, GPT-NeoX, GPT-J), parallel residual (GPT-NeoX, Falcon), learned positions (OPT, GPT-BigCode,
XGLM), multi-latent attention (DeepSeek-V3: a dense layer, then MoE layers with grouped routing and a shared
expert), mixtures of experts stored one tensor per expert (Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V3), logit
soft-capping (Gemma 2) and scaling (Cohere, Granite), embedding scaling (Gemma, Granite).
"""

from __future__ import annotations

import transformers

VOCAB = 96
WINDOW = 5

COMMON = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    max_position_embeddings=128, vocab_size=VOCAB, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    tie_word_embeddings=False,
)
MIXED = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]

# model_type -> overrides of COMMON (and of the config class's defaults)
DECODERS: dict[str, dict] = {
    "qwen3": dict(layer_types=MIXED, sliding_window=WINDOW, use_sliding_window=True),
    "gemma": dict(head_dim=8),
    "gemma2": dict(head_dim=8, sliding_window=WINDOW, final_logit_softcapping=0.5, attn_logit_softcapping=5.0),
    "gemma3_text": dict(head_dim=8, sliding_window=WINDOW, layer_types=MIXED, final_logit_softcapping=0.5),
    "phi3": dict(),
    "phi": dict(partial_rotary_factor=0.5),
    "olmo": dict(),
    "olmo2": dict(),
    "olmo3": dict(sliding_window=WINDOW, layer_types=MIXED),
    "granite": dict(embedding_multiplier=3.0, logits_scaling=4.0, residual_multiplier=0.5, attention_multiplier=0.3),
    "cohere": dict(logit_scale=0.25),
    "cohere2": dict(sliding_window=WINDOW, layer_types=MIXED, logit_scale=0.25),
    "smollm3": dict(no_rope_layers=[1, 0, 1, 1]),
    "glm": dict(head_dim=8),
    "glm4": dict(head_dim=8),
    "gpt_neox": dict(rotary_pct=0.5, use_parallel_residual=True),
    "falcon": dict(alibi=True, new_decoder_architecture=False, multi_query=True, parallel_attn=True),
    "starcoder2": dict(sliding_window=WINDOW),
    "stablelm": dict(partial_rotary_factor=0.5),
    "bloom": dict(n_head=4, n_layer=4),
    "gptj": dict(rotary_dim=4, n_embd=32, n_head=4, n_layer=4, n_positions=128),
    "codegen": dict(rotary_dim=4, n_embd=32, n_head=4, n_layer=4, n_positions=128, n_ctx=128),
    "opt": dict(ffn_dim=64, word_embed_proj_dim=32),
    "gpt_bigcode": dict(n_embd=32, n_head=4, n_layer=4, n_positions=128, multi_query=True),
    "xglm": dict(d_model=32, ffn_dim=64, attention_heads=4, num_layers=4),
    # One dense layer then three MoE layers, grouped routing (2 groups of 2 experts, the best 1 kept), a shared expert.
    "deepseek_v3": dict(
        num_key_value_heads=4, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=4,
        qk_nope_head_dim=8, v_head_dim=8, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
        n_group=2, topk_group=1, n_shared_experts=1,
    ),
    # Mixtures of experts, 4 experts top-2: transformers saves them one tensor per expert and merges them on load.
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "qwen2_moe": dict(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=32,
    ),
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, head_dim=8),
    "gpt_oss": dict(
        head_dim=8, sliding_window=WINDOW, layer_types=MIXED, num_local_experts=4, num_experts_per_tok=2,
    ),
    "helium": dict(head_dim=8),
    "exaone4": dict(sliding_window=WINDOW, layer_types=MIXED),
    "ernie4_5": dict(head_dim=8),
    "apertus": dict(),
    "arcee": dict(),
    "seed_oss": dict(head_dim=8),
    "ministral": dict(head_dim=8, sliding_window=WINDOW, layer_types=MIXED),
    "hunyuan_v1_dense": dict(head_dim=8),
    "nemotron": dict(head_dim=8, partial_rotary_factor=0.5),
    "persimmon": dict(partial_rotary_factor=0.5),
}


def decoder_config(model_type: str, **overrides) -> transformers.PretrainedConfig:
    """The tiny config of ``model_type`` (a key of :data:`DECODERS`)."""
    cls = type(transformers.AutoConfig.for_model(model_type))
    config = cls(**{**COMMON, **DECODERS[model_type], **overrides})
    # No dropout (OPT, GPT-BigCode, XGLM, Seed-OSS default to some): training is compared with transformers'.
    for name, value in vars(config).items():
        if (name.endswith("dropout") or name.endswith("pdrop")) and isinstance(value, float) and name not in overrides:
            setattr(config, name, 0.0)
    return config


# ----------------------------------------------------------------------------- README's table
# What the tests compare with transformers (peft, Trainer) per family; README's architectures table is
# rendered from these (tests/families/test_decoders.py checks it is README's).
STREAMED = tuple(DECODERS)  # a request stream through the serving engine: test_decoders.py
# tests/integrations/test_lora_decoders.py: LoRA at 2 ranks equals peft on one process, per model_type
# with its target_modules (None where peft has a default for the model_type, asserted there) ...
LORA: dict[str, list[str] | None] = {
    "qwen3": None,
    "gemma3_text": None,
    "opt": None,
    "falcon": None,  # query_key_value
    "phi3": ["qkv_proj", "o_proj"],  # fused q/k/v
    "deepseek_v3": ["q_b_proj", "kv_b_proj"],  # multi-latent attention: the up-projections
    "gpt_oss": ["q_proj", "v_proj"],
}
# ... and PipelineTrainer at 2 ranks equals transformers.Trainer on one process
TRAINER = ("qwen3", "gemma3_text", "mixtral", "opt")
# tests/loading/test_tensor_parallel_decoders.py: tp_size=2 inside the stages, with transformers' own plan,
# equals transformers on one process (by the style of its plan that is not plain colwise / rowwise)
TENSOR_PARALLEL = (
    "gemma", "gemma2", "phi", "olmo", "granite", "cohere", "cohere2", "smollm3", "starcoder2", "helium",
    "ernie4_5", "arcee", "seed_oss", "ministral", "nemotron",
    "qwen3", "gemma3_text", "exaone4",  # replicated_with_grad_allreduce (q_norm, k_norm)
    "phi3", "olmo2", "olmo3", "glm", "glm4",  # colwise_gather_output / rowwise_split_input
    "gpt_neox", "gptj", "codegen", "gpt_oss", "hunyuan_v1_dense",  # embedding_rowwise
    "mixtral", "qwen2_moe", "qwen3_moe",  # attention sharded, every expert on every tp rank
)
# tests/families/test_decoders.py: ep_size=2 inside the stages (pp2 x ep2, transformers' base_model_ep_plan) equals
# transformers on one process; tests/loading/test_expert_parallel.py: pp1 x ep2 and pp2 x tp2 x ep2 too
EXPERT_PARALLEL = ("deepseek_v3", "gpt_oss", "mixtral", "qwen2_moe", "qwen3_moe")
# The hand-written recipes' families (model_recipes/{llama,gpt2,bert,t5}.toml): the columns their own test
# files compare (tests/training, tests/generation/test_generate.py and test_beam.py, test_sliding_window.py,
# tests/continuous_batching/test_ring_stream.py and test_ring_sliding_window.py, tests/integrations/test_lora.py
# and test_trainer.py,
# tests/loading/test_tensor_parallel*.py).
COLUMNS = ("forward, training", "generate", "beam", "serve", "LoRA", "Trainer", "tp", "ep")
HAND_WRITTEN = {
    "llama": set(COLUMNS) - {"ep"},  # dense: nothing to split by experts
    "mistral": {"forward, training", "generate", "serve", "tp"},
    "qwen2": {"forward, training", "generate", "beam", "serve", "tp"},
    "gpt2": {"forward, training", "generate", "beam", "serve", "LoRA", "tp"},
    "bert": {"forward, training", "LoRA", "Trainer", "tp"},
    "t5": {"forward, training", "generate", "beam", "serve", "LoRA", "tp"},  # serve: test_ring_encoder_decoder.py
}


def _row(model_type: str, tested: set[str]) -> str:
    from hf_pipeline.planning.options import model_class_for

    config = transformers.AutoConfig.for_model(model_type)
    auto = {"bert": "AutoModelForMaskedLM", "t5": "AutoModelForSeq2SeqLM"}.get(model_type, "AutoModelForCausalLM")
    name = model_class_for(config, auto).__name__
    return f"| `{model_type}` | {name} | " + " | ".join("yes" if c in tested else "-" for c in COLUMNS) + " |"


def support_table() -> str:
    """README's architectures x features table: "yes" where a test compares the feature with transformers."""
    lines = ["| model_type | class | " + " | ".join(COLUMNS) + " |", "|---" * (len(COLUMNS) + 2) + "|"]
    lines += [_row(t, tested) for t, tested in HAND_WRITTEN.items()]
    for model_type in sorted(DECODERS):
        # LoRA: LORA's families at 2 ranks, every other one with both stages in one process (test_lora_decoders.py)
        tested = {"forward, training", "generate", "beam", "LoRA"}
        extra = {"serve": STREAMED, "Trainer": TRAINER, "tp": TENSOR_PARALLEL, "ep": EXPERT_PARALLEL}
        tested |= {column for column, families in extra.items() if model_type in families}
        lines.append(_row(model_type, tested))
    return "\n".join(lines)
