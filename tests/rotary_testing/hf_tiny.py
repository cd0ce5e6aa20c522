"""Tiny random-weight models for the Hugging Face sweep (hf_sweep.py): each
family's default config with every size shrunk, so that a CPU builds and runs
it in well under a second."""

import contextlib

import torch

from .rope_testing import gen

VOCAB = 128
MAX_PARAMS = 3_000_000

# Small everything: each field a family's config has (attribute_map sends the
# standard names to its own spelling).
TINY = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, vocab_size=VOCAB, max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    tie_word_embeddings=False, rotary_dim=8,
    # mixture of experts
    num_experts=4, num_local_experts=4, n_routed_experts=4, moe_num_experts=4, num_experts_per_tok=2,
    moe_intermediate_size=32, shared_expert_intermediate_size=32, n_shared_experts=1, first_k_dense_replace=1,
    n_group=1, topk_group=1, moe_topk=2,
    # multi-head latent attention
    kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
    # sparse-attention indexers keep fewer tokens than the sweep's 12: their rotation shows
    index_topk=4,
    # hybrids: an attention layer among the two (the one RoPE is tested on)
    attn_layer_period=2, attn_layer_offset=1, attn_layer_indices=[1],
    # family spellings of the same sizes (Falcon, Moshi, RecurrentGemma, Gemma 4, Inkling 2, BLT)
    ffn_hidden_size=128, ffn_dim=128, lru_width=64, vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=16,
    unpadded_vocab_size=VOCAB, swa_num_attention_heads=4, swa_num_key_value_heads=2, swa_head_dim=16,
    hidden_size_global=64, encoder_hash_byte_group_vocab=VOCAB,
    # Mamba-2 scans in chunks: the default 256 pads the sweep's 12 tokens to 256 (seconds per family)
    mamba_chunk_size=4,
)
# Mamba mixers sized to the tiny hidden size: a second try, for the hybrids
# whose first build fails (others, e.g. Falcon-H1, build with their own).
MAMBA = dict(mamba_n_heads=4, mamba_d_head=32, mamba_expand=2, mamba_n_groups=1, mamba_d_state=16)


# A family whose defaults need a wider head than TINY's: Qwen3.5's M-RoPE
# sections (11, 11, 10) cover 64 rotated dims, a quarter of the head.
TINY_FOR = {"qwen3_5_text": dict(head_dim=256), "qwen3_5_moe_text": dict(head_dim=256),
            # Mistral 4's table is head_dim x partial_rotary_factor wide, the factor set to
            # rope / (nope + rope): head_dim is nope 8 + rope 8
            "mistral4": dict(head_dim=16),
            # defaults that build no model: LFM2-MoE has no layer_types, DBRX's attention reads a
            # rope_theta and a clip_qkv its config lacks (checkpoints have them), Cohere Compass has
            # no rope_parameters (its M-RoPE sections default to (24, 20, 20): a 128-wide head)
            "lfm2_moe": dict(layer_types=["conv", "full_attention"]),
            # DeepSeek-V4: each layer kind; rope 8 at the end of 16-wide heads and of 32-wide indexer heads;
            # windows of 2 and 4 tokens, so both compressors emit entries within the sweep's 12, and
            # an indexer keeping 2 of its 6, so that its rotation shows
            "deepseek_v4": dict(head_dim=16, index_head_dim=32, index_topk=2,
                                compress_rates={"compressed_sparse_attention": 2, "heavily_compressed_attention": 4},
                                layer_types=["sliding_attention", "compressed_sparse_attention",
                                             "heavily_compressed_attention"]),
            # Dots3-Note's sliding layers keep their default head_dim (global nope 8 + rope 8, sliding 12 + 8)
            "dots3_note_text": dict(head_dim=20),
            # Qwen4-Exp: M-RoPE sections (11, 11, 10) over 64-wide heads, its indexer's too; the indexer has no
            # default sizes (a budget under the sweep's 12)
            "qwen4_exp_text": dict(head_dim=64, indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=64,
                                   indexer_budget=4, indexer_compress_ratio=2, linear_num_key_heads=2, linear_num_value_heads=4,
                                   linear_key_head_dim=16, linear_value_head_dim=16, hc_lowrank=8, ple_embed_dim=16,
                                   ngram_vocab_size_base=VOCAB, split_ngram_parts=2),
            # Falcon-H1 builds with its own Mamba sizes (a 1024-wide SSM of 128 heads, 256 states): the tiny ones
            "falcon_h1": dict(mamba_d_ssm=128, **MAMBA),
            # Dory loops its middle layers: one in, one looped, one out
            "dory": dict(layer_types=["sliding_attention", "full_attention", "sliding_attention"], n_input_layers=1,
                         n_recurrent_layers=1, n_output_layers=1),
            # Gemma 3n's last layers reuse the KV of the last earlier layer of their type
            "gemma3n_text": dict(layer_types=["sliding_attention", "full_attention"] * 2, num_kv_shared_layers=2,
                                 activation_sparsity_pattern=[0.95, 0.0, 0.0, 0.0], laurel_rank=8),
            "dbrx": dict(attn_config=dict(kv_n_heads=2, rope_theta=10000.0, clip_qkv=8.0)),
            "cohere_compass_text": dict(hidden_size=512, head_dim=128, rope_parameters={
                "full_attention": {"rope_type": "default", "rope_theta": 10000.0}}),
            # Phi-4's audio tower (only built, never fed: the sweep's input is text)
            "phi4_multimodal_audio": dict(nemo_conv_channels=64, ext_pw_out_channel=64, depthwise_separable_out_channel=64,
                                          num_blocks=2),
            # a layer with RoPE and one without (no_rope_layers: 1 rotates), so a wrong skip shows
            "smollm3": dict(no_rope_layers=[1, 0]), "llama4_text": dict(no_rope_layers=[1, 0]),
            # two bases, one table each, and a layer without RoPE (base 0)
            **{name: dict(layer_types=["full_attention", "sliding_attention", "sliding_attention"],
                          layer_rope_theta=[10000.0, 0, 500000.0]) for name in ("granite_swa", "granitemoe_swa")},
            # RoPE only with position_embedding_type="rope" / use_mem_rope (by default no rotary_emb is built)
            "granitemoehybrid": dict(position_embedding_type="rope"), "zamba2": dict(use_mem_rope=True),
            # partial_rotary_factor 0.334: 10 rotated dims (16 gives an odd 5)
            "mimo_v2_flash": dict(head_dim=32),
            # a sparse layer too: its indexer rotates with the same cos / sin
            "minimax_m3_vl_text": dict(layer_types=["full_attention", "minimax_m3_sparse"], index_n_heads=2,
                                       index_head_dim=16, index_block_size=64, index_topk_blocks=1)}


def _take_per_layer(config):
    """A heterogeneous config's (per-layer overrides, the globals they differ
    from), cleared from it so that the global fields can be shrunk."""
    if not getattr(config, "is_heterogeneous", False):
        return None
    overrides = {i: dict(v) for i, v in config._heterogeneity_spec.per_layer_overrides.items()}
    names = {k for v in overrides.values() for k in v if k != "skip"}
    base = {k: config._getattr_without_heterogeneous_validation(k, None) for k in names}
    config.per_layer_config = None
    return overrides, base


def _scaled(overrides, base, scale):
    """One layer's overrides at the tiny size, in the ratio they had to the
    default globals (Gemma 4's full layers keep twice the sliding head_dim)."""
    out = {}
    for k, v in overrides.items():
        b, now = base.get(k), scale.get(k)
        if isinstance(v, int) and not isinstance(v, bool) and isinstance(b, int) and b and isinstance(now, int):
            v = max(1, now * v // b)
        out[k] = v
    return out


def _has(config, name):
    return name in getattr(config, "attribute_map", {}) or hasattr(config, name)


def _shrink(config, extra=None):
    """The tiny config of the family: its own class built again with the tiny
    values (so that what its __post_init__ derives, layer_types from layer ids,
    qk_head_dim, kv sharing, follows them), else the default set in place."""
    subs = {name: _shrink(sub, extra) for name in getattr(config, "sub_configs", {})  # composite: each part too
            if hasattr(sub := getattr(config, name, None), "to_dict")}
    per_layer = _take_per_layer(config)
    own = TINY_FOR.get(config.model_type, {})
    values = {k: v for k, v in {**TINY, **own, **(extra or {})}.items()
              if _has(config, k)}  # only fields it has
    if getattr(config, "qk_rope_head_dim", None) and getattr(config, "head_dim", None) and "head_dim" not in own:
        values["head_dim"] = values.get("qk_rope_head_dim", config.qk_rope_head_dim)  # MLA: the rope part's width
    if getattr(config, "kv_lora_rank", None):
        values["num_key_value_heads"] = values.get("num_attention_heads", config.num_attention_heads)  # MLA: all heads
    picked = list(range(values.get("num_hidden_layers", getattr(config, "num_hidden_layers", 0)) or 0))
    types = getattr(config, "layer_types", None)
    if isinstance(values.get("layer_types"), list):  # a TINY_FOR pattern, taken as it is
        values["num_hidden_layers"] = len(values["layer_types"])
        types = types if isinstance(types, (list, tuple)) and types else values["layer_types"]
        picked = [types.index(k) if k in types else None for k in values["layer_types"]]
    elif isinstance(types, (list, tuple)) and types:
        kinds = list(dict.fromkeys(types))  # one layer of each kind, at least two layers
        if all(k in ("linear_attention", "mamba") for k in kinds):
            kinds.append("full_attention")  # a hybrid's attention layer, where RoPE is
        kinds = kinds if len(kinds) > 1 else kinds * 2
        values.update(layer_types=kinds, num_hidden_layers=len(kinds))
        picked = [types.index(k) if k in types else None for k in kinds]  # the default layer each tiny one is
    if per_layer:  # each tiny layer keeps the overrides of the default layer it stands for
        overrides, base = per_layer
        scale = {k: values.get(k, getattr(config, k, None)) for k in base}
        values["per_layer_config"] = {i: _scaled(overrides.get(j, {}), base, scale) for i, j in enumerate(picked)
                                      if overrides.get(j)}
    names = getattr(config, "attribute_map", {})  # the constructor takes its own spellings (DBRX's d_model)
    for tried in (values, _layers_only(values, types)):
        kwargs = {names.get(k, k): v for k, v in tried.items()}
        kwargs = {**subs, **{k: v for k, v in kwargs.items() if not _derived(config, k)}}
        try:
            with _quiet():
                built = type(config)(**kwargs)
        except Exception:
            continue
        kept = list(getattr(built, "layer_types", None) or [])
        if tried is not values or "layer_types" not in values or kept == values["layer_types"]:
            return _eager(built)  # else layer_types is derived (RecurrentGemma): the next try
    for name, value in {**subs, **values}.items():  # a config that takes them only as attributes
        try:
            setattr(config, name, value)
        except Exception:
            pass
    return _eager(config)


def _layers_only(values, types):
    """values for a config whose layer_types derives from its own pattern
    (RecurrentGemma's block_types): the first layers, one of each kind."""
    if "layer_types" not in values:
        return values
    kinds = [k for k in values["layer_types"] if k in types]
    out = {k: v for k, v in values.items() if k not in ("layer_types", "per_layer_config")}
    out["num_hidden_layers"] = max(2, 1 + max(types.index(k) for k in kinds))
    return out


def _derived(config, name):
    """A read-only property (Falcon's head_dim): the constructor refuses it."""
    prop = getattr(type(config), name, None)
    return isinstance(prop, property) and prop.fset is None


@contextlib.contextmanager
def _quiet():
    """transformers logs each kwarg a config cannot set; the fallback sets them."""
    from transformers.utils import logging

    level = logging.get_verbosity()
    logging.set_verbosity(logging.CRITICAL + 1)
    try:
        yield
    finally:
        logging.set_verbosity(level)


def _eager(config):
    config._attn_implementation = "eager"
    return config


def _config_of(model_type):
    """The family's default config."""
    from transformers import AutoConfig

    return AutoConfig.for_model(model_type)


def tiny_model(model_type, cls_name, extra=None):
    import transformers
    from transformers import AutoConfig

    config = _shrink(AutoConfig.for_model(model_type), extra)
    cls = getattr(transformers, cls_name)
    want = getattr(cls, "config_class", None)
    if want is not None and not isinstance(config, want):  # a text-only class under a composite config
        config = next((c for c in (getattr(config, n, None) for n in config.sub_configs) if isinstance(c, want)), config)
    with torch.device("meta"):
        n = sum(p.numel() for p in cls(config).parameters())
    if n > MAX_PARAMS:
        raise RuntimeError(f"{n} parameters with the tiny settings (a composite or unusual config)")
    torch.manual_seed(0)
    return cls(config).eval()


# Multimodal models, outside the causal-LM mapping (or there as their text
# model alone): a tiny model each, its vision tower too, swept like the rest.
VL_FAMILIES = {"qwen2_vl": "Qwen2VLForConditionalGeneration", "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
               "qwen3_vl": "Qwen3VLForConditionalGeneration",
               "ernie4_5_vl_moe": "Ernie4_5_VLMoeForConditionalGeneration",
               "qwen3_5": "Qwen3_5ForConditionalGeneration", "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration",
               "qwen4_exp": "Qwen4ExpForConditionalGeneration", "mllama": "MllamaForConditionalGeneration"}
# Of those, the ones whose text model the sweep shrinks as any other family's
# (hybrid layers, partial spans), under Qwen3-VL's tiny vision tower.
SHRUNK_TEXT = frozenset({"qwen3_5", "qwen3_5_moe", "qwen4_exp"})


def draw_zero_parameters(model):
    """Draws the parameters a model initialises to zero (gates, temperatures),
    so that what they gate reaches the logits."""
    with torch.no_grad():
        for param in model.parameters():
            if param.is_floating_point() and not param.any():
                param.normal_(0.0, 0.5, generator=gen(2))


def _tiny_mllama():
    """Llama 3.2 Vision: 1-D RoPE in its self-attention layers, the image read
    by a cross-attention layer, whose zero-initialised gates are drawn so that
    it changes the logits."""
    import transformers
    from transformers import AutoConfig

    cfg = _shrink(AutoConfig.for_model("mllama"))
    cfg.text_config.cross_attention_layers = [1]
    cfg.vision_config = type(cfg.vision_config)(
        hidden_size=32, num_hidden_layers=1, num_global_layers=1, attention_heads=2, intermediate_size=64,
        vision_output_dim=64, image_size=8, patch_size=4, max_num_tiles=2, intermediate_layers_indices=[0],
        supported_aspect_ratios=[[1, 1], [1, 2], [2, 1]])
    cfg.image_token_index = 100
    torch.manual_seed(0)
    model = transformers.MllamaForConditionalGeneration(cfg)
    draw_zero_parameters(model)
    ids = torch.tensor([[5, 100, 6, 7, 8, 9, 10, 11, 12]])
    inputs = dict(input_ids=ids, pixel_values=torch.randn(1, 1, 2, 3, 8, 8, generator=gen(6)),
                  aspect_ratio_ids=torch.tensor([[2]]), aspect_ratio_mask=torch.tensor([[[1, 1]]]),
                  cross_attention_mask=torch.ones(1, ids.shape[1], 1, 2, dtype=torch.long))
    return model.eval(), inputs


def tiny_vl(family):
    """A random-weight multimodal model and inputs with an image (so an
    M-RoPE family's get_rope_index builds image-grid positions)."""
    import transformers

    torch.manual_seed(0)
    text = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=256)
    if family == "qwen2_vl":
        text["rope_parameters"] = {"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0}
        cfg = transformers.Qwen2VLConfig(
            text_config=text, vision_config=dict(depth=1, embed_dim=32, hidden_size=64, num_heads=2, patch_size=2,
                                                 spatial_merge_size=2, temporal_patch_size=2, in_channels=3, mlp_ratio=2),
            image_token_id=100, video_token_id=101, vision_start_token_id=102, vision_end_token_id=103)
        model = transformers.Qwen2VLForConditionalGeneration(cfg)
    elif family == "qwen2_5_vl":
        text["rope_parameters"] = {"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0}
        cfg = transformers.Qwen2_5_VLConfig(
            text_config=text, vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2,
                                                 patch_size=2, spatial_merge_size=2, temporal_patch_size=2,
                                                 in_channels=3, out_hidden_size=64, window_size=8,
                                                 fullatt_block_indexes=[0]),
            image_token_id=100, video_token_id=101, vision_start_token_id=102, vision_end_token_id=103)
        model = transformers.Qwen2_5_VLForConditionalGeneration(cfg)
    elif family == "ernie4_5_vl_moe":  # h and w pairs alternate, then t; two experts, one per token
        text.update(moe_num_experts=2, moe_k=1, moe_intermediate_size=[32, 32], moe_num_shared_experts=0,
                    rope_parameters={"rope_type": "default", "mrope_section": [2, 2, 4], "rope_theta": 10000.0})
        cfg = transformers.Ernie4_5_VLMoeConfig(
            text_config=text, vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2,
                                                 patch_size=2, spatial_merge_size=2, temporal_merge_size=2,
                                                 in_channels=3),
            image_token_id=100, video_token_id=101, image_start_token_id=102, image_end_token_id=103,
            video_start_token_id=104, video_end_token_id=105)
        model = transformers.Ernie4_5_VLMoeForConditionalGeneration(cfg)
    elif family == "mllama":
        return _tiny_mllama()
    elif family in SHRUNK_TEXT:
        from transformers import AutoConfig

        cfg = _shrink(AutoConfig.for_model(family))
        cfg.vision_config = type(cfg.vision_config)(
            depth=1, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=2, spatial_merge_size=2,
            temporal_patch_size=2, in_channels=3, out_hidden_size=cfg.text_config.hidden_size,
            num_position_embeddings=16)
        cfg.image_token_id, cfg.video_token_id, cfg.vision_start_token_id, cfg.vision_end_token_id = 100, 101, 102, 103
        torch.manual_seed(0)
        model = getattr(transformers, VL_FAMILIES[family])(cfg)
    else:
        text["rope_parameters"] = {"rope_type": "default", "mrope_section": [4, 2, 2], "mrope_interleaved": True,
                                   "rope_theta": 10000.0}
        text["head_dim"] = 16
        cfg = transformers.Qwen3VLConfig(
            text_config=text, vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2,
                                                 patch_size=2, spatial_merge_size=2, temporal_patch_size=2,
                                                 in_channels=3, out_hidden_size=64, num_position_embeddings=16,
                                                 deepstack_visual_indexes=[]),
            image_token_id=100, video_token_id=101, vision_start_token_id=102, vision_end_token_id=103)
        model = transformers.Qwen3VLForConditionalGeneration(cfg)
    ids = torch.tensor([[5, 6, 102] + [100] * 4 + [103, 7, 8]])
    patch = 12 if family == "ernie4_5_vl_moe" else 24  # channels x patch^2 (x temporal_patch_size where it has one)
    inputs = dict(input_ids=ids, pixel_values=torch.randn(16, patch, generator=gen(6)),
                  image_grid_thw=torch.tensor([[1, 4, 4]]), mm_token_type_ids=(ids == 100).long())
    return model.eval(), inputs
