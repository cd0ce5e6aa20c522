"""Per-family RoPE facts of Hugging Face ``transformers`` models, keyed by
``model_type``: how a family pairs dims and which span of the head it rotates.
Read by ``rotary.hf``; every entry is checked against transformers' own
rotary code by tests/python/test_hf_config.py.

- ``pairing``: ``"half"`` pairs ``(j, j + d/2)`` (``rotate_half``);
  ``"interleaved"`` pairs ``(2j, 2j + 1)`` (GPT-J's ``rotate_every_two``,
  ``repeat_interleave``-built cos/sin, complex multiplication).
- ``span``: ``"leading"``: the first ``int(head_dim * partial_rotary_factor)``
  dims; ``"rotary_dim"``: the first ``config.rotary_dim`` dims (GPT-J);
  ``"mla"``: the trailing ``qk_rope_head_dim`` dims of a ``[nope | rope]``
  head (``rotary_offset = qk_nope_head_dim``, DeepSeek MLA); ``"trailing"``:
  the last ``int(head_dim * partial_rotary_factor)`` dims of the head its
  rotation function is given (DeepSeek-V4: the attention's ``head_dim``
  heads, the indexer's ``index_head_dim`` ones).
"""

from dataclasses import dataclass
from typing import Dict, Optional, Tuple

__all__ = ["Family", "FAMILIES", "GENERIC_FIELDS", "DEFAULT_RULE_READS_PARTIAL", "CLASS_THETA", "CLASS_RULE",
           "CLASS_HEAD_DIM", "CLASS_PARTIAL", "CLASS_TOP_PARTIAL", "CLASS_ORIGINAL_MAX", "CLASS_TEXT_CONFIG",
           "CLASS_LAYER_TYPES", "CLASS_PLAIN_ROPE_SCALING", "CLASS_KEEPS_TOP_PARTIAL", "WHOLE_HEAD_ATTENTION",
           "CLASS_AXIAL", "AXIAL_OWN", "family_of"]


@dataclass(frozen=True)
class Family:
    pairing: str = "half"
    span: str = "leading"
    # A config bool that picks the pairing, and its default (True: interleaved).
    interleave_field: Optional[str] = None
    interleave_default: bool = False
    # A fixed base: the family's code ignores rope_theta / rope_parameters.
    theta: Optional[float] = None
    # Default mrope sections (the rotary class's own) and their layout.
    mrope_section: Optional[Tuple[int, ...]] = None
    mrope_interleaved: bool = False
    # Sections (h, w, t) laid out as ERNIE-4.5-VL's class does: h and w
    # alternate over the first 2h pairs, t takes the rest (an explicit
    # pair_axes; _hf_parts.hw_pair_axes).
    mrope_hw_pairs: bool = False
    # (standard name, this family's config.json name), for the dict form.
    aliases: Tuple[Tuple[str, str], ...] = ()
    # Keys of rope_parameters the family's attention reads, not its rotation
    # (Ministral 3 scales q by position with llama_4_scaling_beta).
    attention_keys: Tuple[str, ...] = ()
    # The layout ("BHSD" / "BSHD") in which apply_rotary_emb(xq, xk, freqs_cis)
    # rotates: the rotary_emb returns one complex freqs_cis, not (cos, sin).
    freqs_cis_layout: Optional[str] = None
    # (modeling function, pairing) where one pairs unlike the family's attention
    # (DeepSeek-V3.2's indexer calls a rotate_half apply_rotary_pos_emb).
    function_pairing: Tuple[Tuple[str, str], ...] = ()
    # Rope-named config fields that are not the rotation's: which layers rotate
    # (SmolLM3's no_rope_layers, read by the attention), or none's (documented,
    # never read by transformers' code).
    layer_fields: Tuple[str, ...] = ()
    # A config list of per-layer bases (0: no RoPE), one table per distinct
    # base (GraniteSWA's layer_rope_theta).
    layer_theta_field: Optional[str] = None
    # A config list that only says which layers rotate (0: no RoPE): every
    # other layer rotates at rope_theta, whatever its entry (Muse's
    # layer_rope_theta); an entry other than 0 and the base is refused.
    nope_mask_field: Optional[str] = None
    # The rotated share where rope_parameters gives none, in every rule (GPT-NeoX's class fills it in).
    partial_default: float = 1.0
    # The same for the default rule alone (MiMo-V2-Flash: 0.334): the scaled
    # rules (ROPE_INIT_FUNCTIONS) default to the whole head.
    default_rule_partial: Optional[float] = None
    # The rotary class sizes its table by this field (its default rule; the
    # scaled rules by the field times partial_rotary_factor), not by the
    # span: refused unless they agree (LongCat-Flash's head_dim, unlike other
    # MLA configs, is not set to qk_rope_head_dim; Mistral 4's yarn table is
    # head_dim x 0.5 = qk_rope_head_dim).
    table_dim_field: Optional[str] = None
    # Rotates by the negative angle (NanoChat's rotate_half is cat((x2, -x1))):
    # the patch passes inverse=True to the ops; RotaryEmbedding has no such option.
    inverse: bool = False
    # GPT-NeoX's config.json names: rotary_pct (partial_rotary_factor) and
    # rotary_emb_base (rope_theta), converted by its config class alone.
    neox_fields: bool = False
    # rope_type names the config class rewrites ((Phi-3: "su", "yarn") -> "longrope").
    rule_aliases: Tuple[Tuple[str, str], ...] = ()
    # The only rules the config class's validation accepts (empty: any).
    rules: Tuple[str, ...] = ()
    # Top-level fields the config class folds into rope_parameters keyed by
    # its rope type labels (DeepSeek-V4's, CLASS_ROPE_LABELS): a config not
    # keyed so is refused, and these fields are read through the keys.
    folded_fields: Tuple[str, ...] = ()
    # (short, long): under a scaled rule the class builds the rule's table with
    # no sequence length and scales cos/sin by one of these rope_parameters
    # around original_max_position_embeddings, not by the rule's factor (PhiMoE).
    mscale_keys: Tuple[str, ...] = ()
    # The width heads are cut from, where it is not hidden_size (Qwen2-VL's
    # vision tower: embed_dim; its hidden_size is the merger's output).
    hidden_field: str = "hidden_size"
    # Set: the family is refused, with this reason.
    refuse: Optional[str] = None

    @property
    def fields(self) -> Tuple[str, ...]:
        """Family-specific config fields this entry reads."""
        out = {"rotary_dim": ("rotary_dim",), "mla": ("qk_rope_head_dim", "qk_nope_head_dim", "qk_head_dim")}
        own = (self.interleave_field, self.layer_theta_field, self.nope_mask_field)
        neox = ("rotary_pct", "rotary_emb_base") if self.neox_fields else ()
        return out.get(self.span, ()) + tuple(f for f in own if f) + self.layer_fields + neox + self.folded_fields


# Rope-named config fields whose meaning is the same in every family.
GENERIC_FIELDS = frozenset({
    "rope_theta", "rope_scaling", "rope_parameters", "partial_rotary_factor",
    "ignore_keys_at_rope_validation",  # transformers bookkeeping
})

# The model types whose rotary class reads partial_rotary_factor in its
# default rule (their attention rotates the narrower span; Sarvam-MoE runs
# GLM-4-MoE's). Every other class's default rule rotates the whole head
# whatever the config says (its scaled rules read it): rotary refuses a
# partial_rotary_factor under their default rule rather than guess.
DEFAULT_RULE_READS_PARTIAL = frozenset({
    "bamba", "deepseek_v4", "diffusion_gemma", "diffusion_gemma_text", "dots3_note", "dots3_note_audio_encoder",
    "dots3_note_text", "dots3_note_vision_encoder", "efficientloftr", "glm", "glm4", "glm4_moe", "glm4_moe_lite",
    "glm4v", "glm4v_moe", "glm4v_moe_text", "glm4v_moe_vision", "glm4v_text", "glm4v_vision", "glm_image",
    "glm_image_text", "glm_image_vision", "glm_image_vqmodel", "glm_ocr", "glm_ocr_text", "glm_ocr_vision",
    "glmasr", "glmasr_encoder", "gpt_neox", "gpt_neox_japanese", "laguna", "mellum", "mimo_v2_flash",
    "minimax_m2", "minimax_m3_vl", "minimax_m3_vl_text", "minimax_m3_vl_vision", "moonshine",
    "moonshine_streaming", "moonshine_streaming_encoder", "musicflamingo", "nemo_speechlm", "nemotron",
    "nemotron3_5_transcribe_asr_audio", "nemotron3_5_transcribe_audio", "nemotron3_5_transcribe_word_timestamp",
    "nemotron3_diarization", "nemotron3_diarization_audio", "neomme", "persimmon", "phi", "phi3",
    "phi4_multimodal", "phi4_multimodal_audio", "phi4_multimodal_vision", "qwen3_5", "qwen3_5_moe",
    "qwen3_5_moe_text", "qwen3_5_moe_vision", "qwen3_5_text", "qwen3_5_vision", "qwen3_next", "qwen4_exp",
    "qwen4_exp_text", "qwen4_exp_vision", "recurrent_gemma", "sarvam_moe", "solar_open", "stablelm", "step3p5",
    "step3p5_vision", "step3p7", "zaya",
})

# Of those, the classes whose attention rotates the whole head all the same:
# the narrower table fails there (transformers cannot run a share below 1).
WHOLE_HEAD_ATTENTION = frozenset({"diffusion_gemma", "diffusion_gemma_text", "mellum", "solar_open"})

# The config classes whose "default" rule is their vision tower's "axial"
# one (default_rope_type): their rotary classes run no other rule.
CLASS_AXIAL = frozenset({
    'cohere_compass_vision', 'dots3_note_vision_encoder', 'edgetam_video', 'ernie4_5_vl_moe_vision',
    'exaone4_5_vision', 'gemma4_vision', 'glm4v_moe_vision', 'glm4v_vision', 'glm5_next_vision', 'glm_image_vision',
    'glm_ocr_vision', 'inkling2_vision', 'kimi_k25_vision', 'lfm3_vl_vision', 'minimax_m3_vl_vision', 'mlcd',
    'mlcd_vision_model', 'muse_glimmer_vision', 'muse_spark_vision', 'paddleocr_vl_vision', 'pixtral',
    'qwen2_5_omni_vision_encoder', 'qwen2_5_vl_vision', 'qwen2_vl_vision', 'qwen3_5_moe_vision', 'qwen3_5_vision',
    'qwen3_omni_moe_vision_encoder', 'qwen3_vl_moe_vision', 'qwen3_vl_vision', 'qwen4_exp_vision', 'sam2_video',
    'sam3_tracker_video', 'sam3_vit_model', 'step3p5_vision', 'video_llama_3_vision',
})

# Of those, the towers whose axial rule gives h and w each its own spectrum
# over half the head (pairs j < head_dim / 4 turn by h, the next by w, at
# theta^(-4i / head_dim)), rotated by rotate_half (apply_rotary_pos_emb_vision):
# rotary's axes_dim [head_dim / 2, head_dim / 2]. Each is checked against its
# own rotary class and apply function by tests/python/test_hf_vision_axial.py.
AXIAL_OWN = frozenset({
    'cohere_compass_vision', 'dots3_note_vision_encoder', 'ernie4_5_vl_moe_vision', 'exaone4_5_vision',
    'glm4v_moe_vision', 'glm4v_vision', 'glm5_next_vision', 'glm_ocr_vision', 'lfm3_vl_vision',
    'muse_glimmer_vision', 'muse_spark_vision', 'paddleocr_vl_vision', 'qwen2_5_omni_vision_encoder',
    'qwen2_5_vl_vision', 'qwen2_vl_vision', 'qwen3_5_moe_vision', 'qwen3_5_vision', 'qwen3_omni_moe_vision_encoder',
    'qwen3_vl_moe_vision', 'qwen3_vl_vision', 'qwen4_exp_vision', 'video_llama_3_vision',
})

# What a config object carries and its dict may not: the model types whose
# config class fills in a base other than 10000 (CLASS_THETA: its
# default_theta, or a plain rope_theta default) or a rule other than
# "default" (CLASS_RULE) when the config gives none. A dict of one of them
# without that field is refused (its object is read as is).
CLASS_THETA = frozenset({
    "EvollaModel", "apertus", "apertus1p5_text", "bailing_hybrid", "bitnet", "blt", "blt_global_transformer",
    "blt_local_decoder", "blt_local_encoder", "cohere", "cosmos3_edge_text", "csm", "csm_depth_decoder_model", "cwm",
    "dinov3_vit", "dots3_note_text", "emu3_text_model", "eomt_dinov3", "ernie4_5", "ernie4_5_moe",
    "ernie4_5_vl_moe_text", "evolla", "exaone",
    "flex_olmo", "fuyu", "gemma3_text", "gemma3n_text", "gemma4_vision", "gpt_oss", "gte", "helium", "hy_v3",
    "jina_embeddings_v3", "lfm2", "lfm2_moe", "lfm3", "lfm3_vl_vision", "llama4_text", "longcat_flash", "minimax",
    "minimax_m2", "minimax_m3_vl_text", "mixtral", "mllama_text_model", "modernbert", "modernbert-decoder",
    "muse_glimmer_assistant", "musicflamingo", "neomme", "nomic_bert", "olmo3", "openai_privacy_filter",
    "paddleocr_vl_text", "pe_audio_encoder", "pe_audio_video_encoder", "pe_video_encoder", "phimoe",
    "qwen2_5_omni_talker", "qwen2_5_omni_text", "qwen2_5_vl_text", "qwen2_vl_text", "qwen3_omni_moe_text",
    "qwen3_vl_moe_text", "qwen3_vl_text", "sapiens2", "sarvam_moe", "smollm3", "solar_open", "t5gemma2_decoder",
    "t5gemma2_text",
})
CLASS_RULE = frozenset({
    "apertus", "apertus1p5", "apertus1p5_text", "cwm", "diffusion_gemma", "diffusion_gemma_text", "gemma4",
    "gemma4_text", "gemma4_unified", "gemma4_unified_assistant", "gemma4_unified_text", "gpt_oss",
    "higgs_audio_v2", "lfm3", "lfm3_vl", "ministral3", "mistral4", "mistral_large4", "mistral_large4_text",
    "openai_privacy_filter",
})

# The labels a config class keys rope_parameters by, where they are not its
# layer_types (its _rope_type_labels: a dict does not carry them).
CLASS_ROPE_LABELS: Dict[str, Tuple[str, ...]] = {
    "deepseek_v4": ("main", "compress"), "lfm3": ("full_attention", "sliding_attention"),
}
# What a text config class fills in that its dict may lack, unlike the dict's
# reading (hidden_size // num_attention_heads, the family's partial default,
# max_position_embeddings): a fixed head_dim (CLASS_HEAD_DIM), a
# partial_rotary_factor (CLASS_PARTIAL: the class's value) and
# original_max_position_embeddings (CLASS_ORIGINAL_MAX). A dict of one of them
# without the field is refused where the family reads it.
CLASS_HEAD_DIM = frozenset({
    'afmoe', 'axk1', 'axk2', 'bailing_hybrid', 'beam', 'canary_decoder', 'cohere2_moe', 'cosmos3_edge_text', 'cwm',
    'd_fine', 'deepseek_v2', 'deepseek_v3', 'deepseek_v32', 'deepseek_v4', 'deimv2', 'dia_decoder', 'dia_encoder',
    'dory', 'dots3_note_audio_encoder', 'ernie4_5', 'flint', 'gemma', 'gemma2', 'gemma3_text', 'gemma3n_text',
    'gemma4_vision', 'glm', 'glm4', 'glm4_moe_lite', 'glm_moe_dsa', 'gpt_oss', 'gradium_phonon_tts', 'helium',
    'higgs_audio_v2', 'hrm_text', 'hy_v3', 'hy_v4', 'hy_v4_vl_text', 'inkling2_loop_text', 'inkling2_text',
    'inkling_text', 'internlm3', 'iquestcoder', 'jetmoe', 'kimi_linear', 'kolibri1', 'kosmos_2_5_vision_model',
    'laguna', 'lara_mini', 'lfm3', 'llama4_text', 'longcat_flash', 'longt5', 'mellum', 'mimo_v2_flash', 'minicpm3',
    'minimax_m2', 'minimax_m3_vl_text', 'ministral3', 'mistral4', 'mistral_large4_text', 'molmo2_adapter',
    'molmo2_text', 'molmo2_vision', 'mt5', 'muse_glimmer_assistant', 'muse_glimmer_text', 'muse_spark_text',
    'nemotron_h', 'neomme', 'neucodec', 'openai_privacy_filter', 'paddleocr_vl_text', 'pe_audio_encoder',
    'pe_audio_video_encoder', 'pe_video_encoder', 'pocket_tts', 'qwen2_5_omni_dit', 'qwen2_5_omni_talker', 'qwen3',
    'qwen3_5_moe_text', 'qwen3_5_text', 'qwen3_next', 'qwen3_omni_moe_talker_code_predictor', 'qwen3_vl_text',
    'qwen4_exp_text', 'sarvam_mla', 'sarvam_moe', 'seed_oss', 'solar_open', 'step3p5', 't5', 't5_gemma_module',
    't5gemma2_decoder', 't5gemma2_text', 'timesfm', 'timesfm2_5', 'umt5', 'vaultgemma', 'voxtral_realtime_encoder',
    'xcodec2', 'youtu', 'zamba', 'zamba2', 'zaya',
})
CLASS_PARTIAL = {
    'bamba': 0.5, 'dots3_note_audio_encoder': 0.5, 'efficientloftr': 4.0, 'glm': 0.5, 'glm4': 0.5, 'glm4_moe': 0.5,
    'glm4v_moe_text': 0.5, 'glmasr_encoder': 0.5, 'gpt_neox': 0.25, 'mistral4': 0.5, 'moonshine': 0.9,
    'moonshine_streaming': 0.8, 'nemotron': 0.5, 'nemotron3_5_transcribe_asr_audio': 0.5,
    'nemotron3_5_transcribe_word_timestamp': 0.5, 'persimmon': 0.5, 'phi': 0.5, 'qwen3_5_moe_text': 0.25,
    'qwen3_5_text': 0.25, 'qwen3_next': 0.25, 'recurrent_gemma': 0.5, 'stablelm': 0.25,
}

# A config class that writes its own partial_rotary_factor over a top-level
# one (it keeps one given in rope_parameters): a dict is read with the class's.
CLASS_TOP_PARTIAL = {
    'bamba': 0.5, 'gpt_neox': 0.25, 'gpt_neox_japanese': 1.0, 'mistral4': 0.5, 'moonshine_streaming': 0.8,
    'nemotron3_5_transcribe_asr_audio': 0.5, 'nemotron3_5_transcribe_word_timestamp': 0.5,
}

CLASS_ORIGINAL_MAX = frozenset({'phi3', 'phi4_multimodal'})
# Text config classes that key rope_parameters by layer type: from a flat
# rope_scaling / rope_theta (full_attention's rule, sliding layers plain
# RoPE) or their own per-type defaults; the others' models need them keyed.
# A dict of one of them not keyed by layer type is refused.
CLASS_LAYER_TYPES = frozenset({
    'beam', 'deepseek_v4', 'diffusion_gemma_text', 'dory', 'dots3_note_text', 'embedding_gemma2_text', 'gemma3_text',
    'gemma3n_text', 'gemma4_text', 'gemma4_unified_text', 'laguna', 'lfm3', 'mellum', 'mimo_v2_flash', 'modernbert',
    'modernbert-decoder', 'neomme', 'olmo3', 'step3p5', 't5gemma2_decoder', 't5gemma2_text', 'ultrabert', 'zaya',
})
# Config classes with rope_scaling as a plain field: never moved into
# rope_parameters, so their models ignore it (a dict's is not read either).
CLASS_PLAIN_ROPE_SCALING = frozenset({'cohere2_moe'})
# Config classes whose convert_rope_params_to_dict is a no-op: a top-level
# partial_rotary_factor never reaches rope_parameters, where the rules read it.
CLASS_KEEPS_TOP_PARTIAL = frozenset({'beam', 'laguna', 'mellum', 'mimo_v2_flash'})
# Composite configs whose class builds its text_config from its own defaults,
# not from top-level fields: a dict of one without text_config is refused.
CLASS_TEXT_CONFIG = frozenset({
    'aimv2', 'align', 'altclip', 'apertus1p5', 'aria', 'audioflamingo3', 'aya_vision', 'blip', 'blip-2',
    'bridgetower', 'chinese_clip', 'clap', 'clip', 'clipseg', 'clvp', 'cohere2_vision', 'cohere_compass',
    'cosmos3_edge', 'cosmos3_omni', 'deepseek_ocr2', 'deepseek_vl', 'deepseek_vl_hybrid', 'diffusion_gemma',
    'embedding_gemma2', 'emu3', 'ernie4_5_vl_moe', 'exaone4_5', 'fast_vlm', 'flava', 'florence2', 'fun_asr_nano',
    'gemma3', 'gemma3n', 'gemma4', 'gemma4_unified', 'gemma4_unified_assistant', 'glm46v', 'glm4v', 'glm4v_moe',
    'glm_image', 'glm_ocr', 'glmasr', 'glmga', 'got_ocr2', 'granite4_vision', 'granite_docling', 'granite_speech',
    'granite_speech_plus', 'grounding-dino', 'groupvit', 'hy_v4_vl', 'hyperclovax_vision_v2', 'idefics2',
    'idefics3', 'inkling2', 'inkling2_loop', 'inkling_mm_model', 'instructblip', 'instructblipvideo', 'internvl',
    'janus', 'jev', 'kimi_k25', 'kosmos-2', 'kosmos-2.5', 'lfm2_vl', 'lfm3_vl', 'lighton_ocr', 'llama4', 'llava',
    'llava_next', 'llava_next_video', 'llava_onevision', 'metaclip_2', 'minicpm_ocr', 'minicpmv4_6', 'minicpmv4_7',
    'minimax_m3_vl', 'mistral3', 'mistral_large4', 'mllama', 'mm-grounding-dino', 'modernvbert', 'molmo2',
    'moss_transcribe_diarize', 'muse_glimmer', 'muse_spark', 'musicflamingo', 'nemo_speechlm', 'nemotron_h_omni',
    'omdet-turbo', 'omniasr', 'ovis2', 'owlv2', 'owlvit', 'paligemma', 'pe_audio', 'pe_audio_video', 'pe_video',
    'perception_lm', 'pix2struct', 'pp_chart2table', 'pp_formulanet', 'qianfan_ocr', 'qwen2_5_omni_thinker',
    'qwen2_audio', 'qwen3_5', 'qwen3_5_moe', 'qwen3_asr', 'qwen3_omni_moe_thinker', 'qwen3_vl', 'qwen3_vl_moe',
    'qwen4_exp', 'sam3', 'sam3_lite_text', 'shieldgemma2', 'siglip', 'siglip2', 'smolvlm', 'step3p7',
    't5gemma2_encoder', 'tipsv2', 'ultravbert', 'unlimited_ocr', 'vibevoice', 'vibevoice_asr', 'video_llama_3',
    'video_llava', 'videoprism', 'vipllava', 'vision-text-dual-encoder', 'voxtral', 'voxtral_realtime', 'xclip',
})

_HALF = Family()
_INTER = Family(pairing="interleaved")
_GPTJ = Family(pairing="interleaved", span="rotary_dim", theta=10000.0,
               aliases=(("hidden_size", "n_embd"), ("num_attention_heads", "n_head"),
                        ("max_position_embeddings", "n_positions")))
_QWEN2_VL = Family(mrope_section=(16, 24, 24))
_QWEN3_VL = Family(mrope_section=(24, 20, 20), mrope_interleaved=True)
_QWEN3_5 = Family(mrope_section=(11, 11, 10), mrope_interleaved=True)  # over a partial span
_NOT_VERIFIED = "its rotary code is not rotate_half over one leading span, and rotary does not verify it"

FAMILIES: Dict[str, Family] = {
    # rotate_half over the first int(head_dim * partial_rotary_factor) dims
    **{name: _HALF for name in (
        "llama", "mistral", "mixtral", "qwen2", "qwen3", "qwen3_moe", "phi", "stablelm",
        "persimmon", "gemma", "olmo", "olmo2", "granite", "starcoder2", "glm4_moe")},
    # GPT-NeoX: 4.x config.json names; its class rotates a quarter of the head by default.
    "gpt_neox": Family(neox_fields=True, partial_default=0.25),
    "gpt_neox_japanese": Family(neox_fields=True),
    **{name: Family(rule_aliases=(("su", "longrope"), ("yarn", "longrope")), rules=("default", "longrope"))
       for name in ("phi3", "phi4_multimodal")},
    "ministral3": Family(attention_keys=("llama_4_scaling_beta",)),
    "phimoe": Family(mscale_keys=("short_mscale", "long_mscale")),
    "recurrent_gemma": Family(rules=("default",)),  # its rotary class raises on any other
    # multimodal RoPE, rotate_half
    "qwen2_vl": _QWEN2_VL, "qwen2_vl_text": _QWEN2_VL,
    "qwen2_5_vl": _QWEN2_VL, "qwen2_5_vl_text": _QWEN2_VL,
    "qwen3_vl": _QWEN3_VL, "qwen3_vl_text": _QWEN3_VL,
    # Cohere Compass: Qwen3-VL's layout and sections, per layer type (None: no RoPE).
    "cohere_compass_text": _QWEN3_VL,
    "qwen3_5_text": _QWEN3_5, "qwen3_5_moe_text": _QWEN3_5,
    # The same rotary classes under other names (their sections' defaults too).
    **{name: _QWEN2_VL for name in ("qwen2_5_omni_text", "qwen2_5_omni_talker", "paddleocr_vl_text")},
    **{name: _QWEN3_VL for name in ("qwen3_vl_moe_text", "qwen3_omni_moe_text", "qwen3_omni_moe_talker_text",
                                    "cosmos3_edge_text")},
    **{name: Family(mrope_section=(8, 12, 12)) for name in ("glm_image_text", "glm4v_moe_text")},
    # GLM-4.1V / GLM-OCR: the same sections in chunks, but rotate_half_llm's
    # (2j, 2j+1) pairs (cos/sin repeat_interleave'd), over a partial span.
    **{name: Family(pairing="interleaved", mrope_section=(8, 12, 12)) for name in ("glm4v_text", "glm_ocr_text")},
    # (2j, 2j+1) pairs: rotate_every_two, or cos/sin built with repeat_interleave
    "gptj": _GPTJ, "codegen": _GPTJ,
    **{name: _INTER for name in ("cohere", "glm", "glm4", "helium", "ernie4_5", "ernie4_5_moe")},
    # Moonshine's decoder and encoder: cos/sin's first halves repeat_interleave'd,
    # (2j, 2j+1) pairs; the table's head_dim from the decoder's heads.
    "moonshine": Family(pairing="interleaved", aliases=(("num_attention_heads", "decoder_num_attention_heads"),)),
    "moonshine_streaming": _INTER,
    # OpenAI's privacy filter: x[..., ::2] / x[..., 1::2] pairs over the whole head.
    "openai_privacy_filter": _INTER,
    "moonshine_streaming_encoder": Family(refuse="its encoder has no RoPE (sliding-window attention only); "
                                                 "its decoder, model_type 'moonshine_streaming', rotates"),
    # Perception Encoder audio / video: stack_freqs pairs (2j, 2j+1).
    **{name: _INTER for name in ("pe_audio_encoder", "pe_video_encoder", "pe_audio_video_encoder")},
    # MLA [nope | rope] heads: DeepSeek-V2 rotates complex pairs (interleaved);
    # DeepSeek-V3 / GLM-4.7-Flash interleave when rope_interleave (default True).
    "deepseek_v2": Family(pairing="interleaved", span="mla", freqs_cis_layout="BHSD"),
    "deepseek_v3": Family(span="mla", interleave_field="rope_interleave", interleave_default=True),
    # Sarvam-105B is DeepseekV3ForCausalLM with its own config class.
    "sarvam_mla": Family(span="mla", interleave_field="rope_interleave", interleave_default=True),
    "glm4_moe_lite": Family(span="mla", interleave_field="rope_interleave", interleave_default=True),
    # Mistral 4: DeepSeek-V3's MLA rotation; its attention scales q by position (llama_4_scaling_beta).
    "mistral4": Family(span="mla", interleave_field="rope_interleave", interleave_default=True,
                       attention_keys=("llama_4_scaling_beta",), table_dim_field="head_dim"),
    "axk1": Family(span="mla", interleave_field="rope_interleave", interleave_default=True),
    "youtu": Family(span="mla", interleave_field="rope_interleave", interleave_default=True),
    # MLA heads rotated with rotate_half on q_rot / k_rot.
    "minicpm3": Family(span="mla"), "hy_v4": Family(span="mla"),
    # MLA always through apply_rotary_pos_emb_interleave (no rope_interleave
    # field), GlmMoeDsa's sparse-attention indexer too; BailingHybrid's linear
    # attention layers have no RoPE (its config.json says model_max_length).
    "glm_moe_dsa": Family(pairing="interleaved", span="mla"),
    "longcat_flash": Family(pairing="interleaved", span="mla", table_dim_field="head_dim"),
    "bailing_hybrid": Family(pairing="interleaved", span="mla",
                             aliases=(("max_position_embeddings", "model_max_length"),)),
    # The same, but the indexer's apply_rotary_pos_emb is rotate_half.
    **{name: Family(pairing="interleaved", span="mla", function_pairing=(("apply_rotary_pos_emb", "half"),))
       for name in ("axk2", "deepseek_v32")},
    # RoPE on some layers only: the others never call apply_rotary_pos_emb.
    # Cohere 2 rotates its sliding-window layers (and Cohere2Moe's force_rope
    # ones), pairs (2j, 2j+1) over the whole head.
    **{name: _INTER for name in ("cohere2", "cohere2_moe")},
    "smollm3": Family(layer_fields=("no_rope_layers", "no_rope_layer_interval")),
    # Zamba2's shared attention rotates only with use_mem_rope (no rotary_emb without it).
    "zamba2": Family(layer_fields=("use_mem_rope",), aliases=(("head_dim", "attention_head_dim"),)),
    # The config classes' attribute_map names, which config.json is written in.
    "jetmoe": Family(aliases=(("head_dim", "kv_channels"),)),
    "dbrx": Family(aliases=(("hidden_size", "d_model"), ("num_attention_heads", "n_heads"),
                            ("max_position_embeddings", "max_seq_len"))),
    **{name: Family(layer_theta_field="layer_rope_theta") for name in ("granite_swa", "granitemoe_swa")},
    **{name: Family(nope_mask_field="layer_rope_theta") for name in ("muse_glimmer_text", "muse_spark_text")},
    # Per-layer-type rules, each rotating int(head_dim * partial_rotary_factor).
    "mimo_v2_flash": Family(default_rule_partial=0.334),
    # MiniMax-M3 rotates int(head_dim * partial_rotary_factor) dims; its
    # documented rotary_dim is never read.
    "minimax_m3_vl_text": Family(layer_fields=("rotary_dim",)),
    # NanoChat's rotate_half is cat(x2, -x1): the negative angle.
    "nanochat": Family(inverse=True),
    # Llama 4: complex pairs (2j, 2j+1) from a freqs_cis in BSHD, none on its no_rope_layers.
    **{name: Family(pairing="interleaved", freqs_cis_layout="BSHD",
                    layer_fields=("no_rope_layers", "no_rope_layer_interval")) for name in ("llama4", "llama4_text")},
    # DeepSeek-V4: (2j, 2j+1) pairs over each head's trailing span, tables keyed
    # by rope type ("main", "compress"). Its k is its v, so the attention output
    # is turned back with (cos, -sin): the inverse rotation.
    "deepseek_v4": Family(pairing="interleaved", span="trailing",
                          folded_fields=("compress_rope_theta", "qk_rope_head_dim")),
    # Read from their modeling code: rotations beyond q and k, or none through rotary_emb.
    "inkling2_text": Family(refuse="its text layers have no RoPE (a relative position bias); only its vision "
                                   "tower rotates, through apply_rotary_pos_emb_vision"),
    # Qwen4-Exp: Qwen3.5's M-RoPE ((11, 11, 10) interleaved), over the whole position
    # history, which its attention and indexer index (RotaryPositions.__getitem__).
    "qwen4_exp_text": _QWEN3_5,
    # The AXIAL_OWN towers: their config classes map num_attention_heads to
    # num_heads, the name their dicts hold.
    **{name: Family(aliases=(("num_attention_heads", "num_heads"),)) for name in AXIAL_OWN},
    "qwen2_vl_vision": Family(aliases=(("num_attention_heads", "num_heads"),), hidden_field="embed_dim"),
    # ERNIE-4.5-VL: (2j, 2j+1) pairs at the plain frequencies; its class
    # pre-permutes inv_freq so that pair j < 2h turns by h (even j) or w
    # (odd j), the rest by t. Its class runs the default rule alone.
    "ernie4_5_vl_moe_text": Family(pairing="interleaved", mrope_section=(22, 22, 20), mrope_hw_pairs=True,
                                   rules=("default",)),
    # Dots3-Note: MLA through apply_rotary_pos_emb_interleave (its indexer too),
    # per layer type (per_layer_config), each type's table head_dim x its
    # partial_rotary_factor wide (its class reads the factor in the default rule).
    "dots3_note_text": Family(pairing="interleaved", span="mla", table_dim_field="head_dim"),
    "roformer": Family(refuse="a staticmethod of its attention rotates with an nn.Embedding sinusoidal table "
                              "(no rotary_emb to patch)"),
    **{name: Family(refuse=_NOT_VERIFIED) for name in (
        "blt", "dots3_note", "efficientloftr", "hy_v4_vl", "hy_v4_vl_text", "hunyuan_vl", "hunyuan_vl_text",
        "lightglue",
        "mistral_large4", "mistral_large4_text", "blt_global_transformer", "blt_local_decoder", "blt_local_encoder",
        "blt_patcher", "inkling2", "neomme",
        "edgetam_video", "sam2_video", "sam3", "sam3_tracker_video")},
}


# Read as Llama's (no entry above) and checked against transformers' own
# rotary class by a test outside the HF sweep, which builds no causal LM of
# them: model_type -> the test.
VERIFIED_BY_TESTS: Dict[str, str] = {
    "esm": "tests/python/test_hf_trials_rules.py::test_esm_rotates_only_with_rotary_positions_and_its_top_level_base",
    "step3p5": "tests/python/test_hf_trials.py::test_a_heterogeneous_config_whose_layers_keep_the_rotation_is_served",
}


def family_of(model_type: str) -> Optional[Family]:
    return FAMILIES.get(model_type)
