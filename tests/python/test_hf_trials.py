"""from_hf_config on the configs a trial found silently wrong: each is read
as transformers' own rotary class reads it (inv_freq and attention scaling
against that class's, built from the same config), or refused by name. The
tables these rules rest on are checked against transformers' code."""

import copy
import importlib
import importlib.util
import inspect
import warnings

import pytest
import torch

import rotary
from rotary import hf_families
from rotary.hf import rope_kwargs_from_hf_config

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.filterwarnings("ignore")

SMALL = dict(hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=32, max_position_embeddings=256)


def config(cls_name, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return getattr(transformers, cls_name)(**copy.deepcopy(kw))


def assert_same_rule(ours, theirs):
    """inv_freq and attention scaling of our module against a transformers rotary class's."""
    torch.testing.assert_close(ours.inv_freq, theirs.inv_freq.double(), rtol=1e-6, atol=0)
    assert ours.attention_scaling == pytest.approx(theirs.attention_scaling, rel=1e-6)


def modeling(name):
    return importlib.import_module(f"transformers.models.{name}.modeling_{name}")


# ------------------------------------------------- the tables, against transformers
def test_default_rule_reads_partial_is_transformers_own():
    """Every rotary class whose default rule reads partial_rotary_factor, by
    its source, for every model type of transformers' config mapping (and
    the package of its causal LM where that is another family's: Sarvam-MoE
    runs Glm4MoeForCausalLM)."""
    from rotary._hf_refusals import modeling_modules

    reads = set()
    for model_type in transformers.CONFIG_MAPPING:
        for name in modeling_modules(model_type):
            try:
                mod = importlib.import_module(name)
            except Exception:  # a modeling file needing an optional package: none of the served families
                continue
            for name, obj in vars(mod).items():
                if (inspect.isclass(obj) and name.endswith("RotaryEmbedding") and obj.__module__ == mod.__name__
                        and hasattr(obj, "compute_default_rope_parameters")
                        and "partial_rotary_factor" in inspect.getsource(obj.compute_default_rope_parameters)):
                    reads.add(model_type)
    assert reads == set(hf_families.DEFAULT_RULE_READS_PARTIAL)


def test_a_rotary_class_that_runs_only_its_default_rule_refuses_others():
    """Rotary classes that raise on any rule but "default" (RecurrentGemma's),
    found by their source: a scaled rule in such a config is refused, not
    served as the rule would be elsewhere."""
    import re

    from rotary._hf_refusals import modeling_modules

    only_default = re.compile(r'rope_type != "default":\s*\n\s*raise ')
    found = set()
    for model_type, cls in transformers.CONFIG_MAPPING.items():
        for name in modeling_modules(model_type):
            spec = importlib.util.find_spec(name)
            if spec and spec.origin and only_default.search(open(spec.origin).read()):
                found.add(model_type)
    assert "recurrent_gemma" in found
    for model_type in sorted(found):
        given = transformers.CONFIG_MAPPING[model_type]().to_dict()
        # A composite's rule is its text model's (transformers ignores one at the top).
        target = given["text_config"] if isinstance(given.get("text_config"), dict) else given
        target["rope_parameters"] = {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0,
                                     "partial_rotary_factor": 0.5}  # RecurrentGemma's own share
        with pytest.raises(ValueError, match=rf"rope_type 'linear'(: transformers' | for model_type '){model_type}"
                                             if model_type != "eomt_dinov3" else model_type):
            rope_kwargs_from_hf_config(given)


def test_class_rope_labels_are_transformers_own():
    labels = {mt: tuple(cls._rope_type_labels) for mt, cls in transformers.CONFIG_MAPPING.items()
              if getattr(cls, "_rope_type_labels", None)}
    assert labels == hf_families.CLASS_ROPE_LABELS


def test_class_axial_is_transformers_own():
    """The config classes whose default rule is axial (default_rope_type)."""
    axial = {mt for mt, cls in transformers.CONFIG_MAPPING.items() if getattr(cls, "default_rope_type", "") == "axial"}
    assert axial == set(hf_families.CLASS_AXIAL)


def test_class_defaults_are_transformers_own():
    """The model types whose config class fills in a base other than 10000
    (its default_theta, or a plain dataclass default of rope_theta, as
    BailingHybrid's 6e6), or a rule other than the default (vision towers'
    axial rules aside)."""
    thetas, rules = set(), set()
    for model_type, cls in transformers.CONFIG_MAPPING.items():
        for theta in (getattr(cls, "default_theta", None), getattr(cls, "rope_theta", None)):
            if theta is not None and (not isinstance(theta, (int, float)) or float(theta) != 10000.0):
                thetas.add(model_type)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                text = cls().get_text_config()
        except Exception:  # no default instance, or several text configs: read from objects only
            continue
        params = getattr(text, "rope_parameters", None)
        if isinstance(params, dict) and params:
            flat = [v for v in params.values() if isinstance(v, dict)] or [params]
            kinds = {v.get("rope_type", "default") for v in flat}
            if kinds not in ({"default"}, {"axial"}):
                rules.add(model_type)
    assert thetas == set(hf_families.CLASS_THETA)
    assert rules == set(hf_families.CLASS_RULE)


def _class_fields(cls):
    """Whether a text config class fills in head_dim, partial_rotary_factor
    (its value) and original_max_position_embeddings otherwise than a dict
    without them is read (hidden_size // num_attention_heads, 1.0,
    max_position_embeddings)."""
    a = cls()
    params = getattr(a, "rope_parameters", None)
    partial = None
    if isinstance(params, dict) and not any(isinstance(v, dict) for v in params.values()):
        partial = params.get("partial_rotary_factor") if params.get("partial_rotary_factor") != 1.0 else None
    m, original = getattr(a, "max_position_embeddings", None), False
    if isinstance(getattr(a, "original_max_position_embeddings", None), int) and isinstance(m, int):
        try:
            original = cls(max_position_embeddings=2 * m).original_max_position_embeddings != 2 * m
        except Exception:  # cannot say: treated as filled in (refused)
            original = True
    hd, h, n = getattr(a, "head_dim", None), getattr(a, "hidden_size", None), getattr(a, "num_attention_heads", None)
    head = False
    if all(isinstance(v, int) and v > 0 for v in (hd, h, n)):
        try:
            head = not (hd == h // n and cls(hidden_size=2 * h, num_attention_heads=n).head_dim == (2 * h) // n)
        except Exception:
            head = True
    return head, partial, original


def test_class_fields_of_dicts_are_transformers_own():
    """What a dict lacking head_dim, partial_rotary_factor,
    original_max_position_embeddings or (a composite's) text_config would be
    read as differently from its config class (hf_families.CLASS_*)."""
    heads, partials, originals, composites, seen = set(), {}, set(), set(), set()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for model_type, cls in transformers.CONFIG_MAPPING.items():
            try:
                top = cls()
                text = type(top.get_text_config())
                if text is not cls and hasattr(top, "text_config"):
                    h = top.get_text_config().hidden_size
                    if isinstance(h, int) and cls.from_dict({"hidden_size": 2 * h}).get_text_config().hidden_size != 2 * h:
                        composites.add(model_type)
                if text in seen:
                    continue
                seen.add(text)
                head, partial, original = _class_fields(text)
            except Exception:  # no default instance, several text configs, per-layer attributes
                continue
            if head:
                heads.add(text.model_type)
            if partial is not None:
                partials[text.model_type] = partial
            if original:
                originals.add(text.model_type)
    assert heads == set(hf_families.CLASS_HEAD_DIM)
    assert partials == hf_families.CLASS_PARTIAL
    assert originals == set(hf_families.CLASS_ORIGINAL_MAX)
    assert composites == set(hf_families.CLASS_TEXT_CONFIG)


def test_classes_that_write_their_own_partial_over_a_top_level_one():
    """A top-level partial_rotary_factor these config classes replace with
    their own (hf_families.CLASS_TOP_PARTIAL): a dict giving one is read as
    the class reads it, not with the dict's value."""
    over = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for model_type, cls in transformers.CONFIG_MAPPING.items():
            try:
                c = cls.from_dict({"partial_rotary_factor": 0.75})
                if c.get_text_config() is not c:
                    continue
            except Exception:  # no default instance, several text configs
                continue
            params = getattr(c, "rope_parameters", None)
            if isinstance(params, dict) and params.get("partial_rotary_factor") not in (None, 0.75):
                over[model_type] = params["partial_rotary_factor"]
        assert over == hf_families.CLASS_TOP_PARTIAL
        for model_type in ("bamba", "moonshine_streaming"):  # served, read from the dict's own rule
            cls = transformers.CONFIG_MAPPING[model_type]
            d = {**cls().to_dict(), "partial_rotary_factor": 0.75, "rope_theta": 10000.0}
            d.pop("rope_parameters", None)
            obj = cls.from_dict(dict(d))
            assert rope_kwargs_from_hf_config(d) == rope_kwargs_from_hf_config(obj), model_type


@pytest.mark.parametrize("model_type,missing,given,match", [
    ("qwen3", "head_dim", dict(hidden_size=96, num_attention_heads=2), "no head_dim"),
    ("phi", "partial_rotary_factor", dict(hidden_size=96, num_attention_heads=2), "no partial_rotary_factor.*0.5"),
    ("stablelm", "partial_rotary_factor", dict(hidden_size=96, num_attention_heads=2), "no partial.*fills in 0.25"),
    ("phi3", "original_max_position_embeddings",
     dict(hidden_size=64, num_attention_heads=2, rope_scaling={"rope_type": "longrope", "short_factor": [1.0] * 16,
                                                              "long_factor": [2.0] * 16}),
     "no original_max_position_embeddings"),
    ("llama4", "text_config", dict(hidden_size=96, num_attention_heads=2), "no text_config"),
])
def test_a_dict_without_a_field_its_class_fills_in_is_refused(model_type, missing, given, match):
    """transformers reads these dicts with its class's value (qwen3: head_dim
    128, not 96 // 2); rotary refuses rather than read another. With the field
    given, they agree."""
    d = dict(given, model_type=model_type, max_position_embeddings=1000, rope_theta=10000.0)
    with pytest.raises(ValueError, match=rf"the {model_type} dict has {match}"):
        rotary.RotaryEmbedding.from_hf_config(d)
    cls = transformers.CONFIG_MAPPING[model_type]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        obj = cls.from_dict(dict(d))
    # Every field given (the class's to_dict): read as the config object is.
    assert rope_kwargs_from_hf_config(obj.to_dict()) == rope_kwargs_from_hf_config(obj)


# --------------------------------------------------------- partial rotary
def test_partial_under_a_default_rule_that_ignores_it_is_refused():
    """Llama's default rule rotates the whole head whatever the config says."""
    for cfg in (config("LlamaConfig", **SMALL, rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                                                 "partial_rotary_factor": 0.5}),
                dict(SMALL, model_type="llama", partial_rotary_factor=0.5)):
        with pytest.raises(ValueError, match=r"partial_rotary_factor=0.5: transformers' llama rotary class is not "
                                             r"known to read it in its default rule"):
            rotary.RotaryEmbedding.from_hf_config(cfg)


def test_partial_under_a_default_rule_that_reads_it():
    cfg = config("Phi3Config", **SMALL, rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                                          "partial_rotary_factor": 0.5})
    ours = rotary.RotaryEmbedding.from_hf_config(cfg)
    assert ours.dim == 8
    assert_same_rule(ours, modeling("phi3").Phi3RotaryEmbedding(cfg))


@pytest.mark.parametrize("name,value", [("rotary_pct", 0.5), ("rotary_emb_base", 100)])
def test_gpt_neox_field_names_are_gpt_neox_only(name, value):
    with pytest.raises(ValueError, match=rf"{name}={value} is not read for model_type 'llama'"):
        rotary.RotaryEmbedding.from_hf_config(dict(SMALL, model_type="llama", rope_theta=1e4, **{name: value}))


def test_gpt_neox_dict_defaults_as_its_config_class():
    """No rotary_pct: a quarter of the head; rotary_emb_base is the base."""
    d = dict(SMALL, model_type="gpt_neox", rotary_emb_base=500)
    ours = rotary.RotaryEmbedding.from_hf_config(d)
    assert ours.dim == 4 and ours.theta == 500
    assert_same_rule(ours, modeling("gpt_neox").GPTNeoXRotaryEmbedding(config("GPTNeoXConfig", **d)))


# ------------------------------------------------------ what a dict lacks
def test_a_dict_without_what_its_config_class_fills_in_is_refused():
    with pytest.raises(ValueError, match=r"the mixtral dict has no rope_theta; its config class fills in a base"):
        rotary.RotaryEmbedding.from_hf_config(dict(SMALL, model_type="mixtral"))
    with pytest.raises(ValueError, match=r"the cwm dict has no rope_parameters; its config class fills in a scaled"):
        rotary.RotaryEmbedding.from_hf_config(dict(SMALL, model_type="cwm", rope_theta=1e6))
    # Given, or on the object, it is read.
    d = dict(SMALL, model_type="mixtral", rope_theta=1e6)
    assert_same_rule(rotary.RotaryEmbedding.from_hf_config(d),
                     modeling("mixtral").MixtralRotaryEmbedding(config("MixtralConfig", **d)))
    cfg = config("MixtralConfig", **SMALL)
    assert_same_rule(rotary.RotaryEmbedding.from_hf_config(cfg), modeling("mixtral").MixtralRotaryEmbedding(cfg))


def test_a_text_config_without_model_type_needs_a_known_composite():
    d = {"model_type": "aya_vision", "text_config": dict(SMALL, rope_theta=1e4)}
    with pytest.raises(ValueError, match=r"text_config has no model_type, and 'aya_vision' does not say"):
        rotary.RotaryEmbedding.from_hf_config(d)
    d = {"model_type": "qwen2_vl", "text_config": dict(SMALL, rope_theta=1e4, rope_scaling={
        "type": "mrope", "mrope_section": [2, 3, 3]})}
    assert rotary.RotaryEmbedding.from_hf_config(d).mrope_section == [2, 3, 3]


def test_a_heterogeneous_config_is_refused():
    cfg = config("Gemma4TextConfig", **dict(SMALL, head_dim=16, num_hidden_layers=2,
                                            layer_types=["sliding_attention", "full_attention"]))
    if not cfg.to_dict().get("per_layer_config"):
        pytest.skip("this Gemma 4 config is not heterogeneous")
    for given in (cfg.to_dict(), cfg):
        with pytest.raises(ValueError, match=r"per_layer_config: gemma4_text sets head_dim per layer, so one table "
                                             r"does not serve its layers; pass the config object's "
                                             r"per_layer_config\[layer_type\]"):
            rotary.RotaryEmbedding.from_hf_config(given, layer_type="full_attention")


@pytest.mark.parametrize("head_dim", [16, None])
def test_a_heterogeneous_config_whose_layers_keep_the_rotation_is_served(head_dim):
    """Step-3.5's sliding layers override their head counts only: its rotary
    class builds every table from the top-level config, as rotary does from
    the object and its dict alike. A dict without head_dim is refused for
    that (its class fills in its own), not for the head counts."""
    kw = dict(num_hidden_layers=4, hidden_size=64, num_attention_heads=4, num_sliding_attention_heads=2,
              layer_types=["sliding_attention", "full_attention"] * 2,
              rope_theta=[1e4, 5e5] * 2, partial_rotary_factors=[0.5, 1.0] * 2)
    cfg = config(transformers.CONFIG_MAPPING["step3p5"].__name__, **kw, **({"head_dim": head_dim} if head_dim else {}))
    given = cfg.to_dict()
    assert given["per_layer_config"] and cfg.is_heterogeneous
    if head_dim is None:
        given.pop("head_dim")
        with pytest.raises(ValueError, match=r"the step3p5 dict has no head_dim; its config class fills in"):
            rope_kwargs_from_hf_config(given, layer_type="full_attention")
        return
    theirs = modeling("step3p7").Step3p7RotaryEmbedding(cfg)
    for layer_type in ("sliding_attention", "full_attention"):
        ours = rotary.RotaryEmbedding.from_hf_config(cfg, layer_type=layer_type)
        assert rope_kwargs_from_hf_config(given, layer_type=layer_type) == rope_kwargs_from_hf_config(
            cfg, layer_type=layer_type)
        torch.testing.assert_close(ours.inv_freq, getattr(theirs, f"{layer_type}_inv_freq").double(), rtol=1e-6, atol=0)
    assert rotary.RotaryEmbedding.from_hf_config(cfg, layer_type="sliding_attention").dim == 8  # half of 16


def test_a_step3p5_model_whose_layers_differ_in_head_counts_alone_is_patched():
    # transformers refuses per_layer_config[layer_type] when a type's layers
    # differ; the patch reads the whole config, as from_hf_config does.
    from rotary.integrations.transformers import apply_rotary_to_model, unpatch

    kw = dict(num_hidden_layers=4, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              vocab_size=64, intermediate_size=32, moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2,
              share_expert_dim=16, layer_types=["sliding_attention", "full_attention"] * 2, max_position_embeddings=128,
              sliding_window=8, rope_theta=[1e4, 5e5] * 2, partial_rotary_factors=[0.5, 1.0] * 2,
              mlp_layer_types=["dense"] * 4, per_layer_config={0: {"num_attention_heads": 2}})
    cfg = config(transformers.CONFIG_MAPPING["step3p5"].__name__, **kw)
    torch.manual_seed(0)
    model = modeling("step3p7").Step3p7TextModel(cfg).eval()
    ids = torch.randint(0, 64, (1, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model(ids).last_hidden_state
        apply_rotary_to_model(model, allow_unverified=True)
        try:
            got = model(ids).last_hidden_state
        finally:
            unpatch(model)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=0)


@pytest.mark.parametrize("cls", ["LlamaConfig", "RecurrentGemmaConfig"])
def test_a_rule_keyed_by_a_label_the_config_does_not_declare_is_refused(cls):
    # transformers nests rope_parameters only under the config's layer types
    # (or rope type labels): here the dict is a flat rule's unknown field, and
    # transformers rotates with its defaults, not with the nested base.
    given = config(cls, hidden_size=64, num_attention_heads=4, num_key_value_heads=4, intermediate_size=32,
                   vocab_size=32, num_hidden_layers=1).to_dict()
    given["rope_parameters"] = {"sliding_attention": {"rope_type": "default", "rope_theta": 5e5,
                                                      "partial_rotary_factor": 0.5}}
    with pytest.raises(ValueError, match=r"layer_type='sliding_attention', but rope_parameters is not keyed by "
                                         r"layer type"):
        rope_kwargs_from_hf_config(given, layer_type="sliding_attention")
    with pytest.raises(ValueError, match=r"rope_parameters\['sliding_attention'\]=.* is a field no rule of rotary "
                                         r"has"):
        rope_kwargs_from_hf_config(given)
