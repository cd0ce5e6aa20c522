"""An independent float64 reference of the published frequency rules, in
plain Python math (no torch, no code shared with the package)."""

import math


def ref_frequencies(d, theta, p, seq_len=0):
    """(inv_freq list, attention scaling) of rule p (an HF-style dict) for a
    rotary dim d, re-derived from the formulas in transformers'
    modeling_rope_utils and the papers they cite."""
    kind = p.get("rope_type", p.get("type", "default"))
    pairs = range(d // 2)

    def plain(base):
        # pair j turns base^(-2j/d) radians per position
        return [1.0 / base ** (2.0 * j / d) for j in pairs]

    if kind == "default":
        return plain(theta), 1.0
    if kind == "linear":  # position interpolation: positions / factor
        return [w / p["factor"] for w in plain(theta)], 1.0
    if kind == "ntk":  # static NTK-aware: a larger base, same for every pair
        return plain(theta * p["factor"] ** (d / (d - 2.0))), 1.0
    if kind == "dynamic":  # NTK with a base that grows with the sequence
        m = p["max_position_embeddings"]
        n = max(seq_len, m)
        s = p["factor"] * n / m - (p["factor"] - 1.0)
        return plain(theta * s ** (d / (d - 2.0))), 1.0
    if kind == "yarn":
        orig = p["original_max_position_embeddings"]
        factor = p.get("factor") or p["max_position_embeddings"] / orig

        def temperature(scale, m=1.0):
            return 1.0 if scale <= 1 else 1.0 + 0.1 * m * math.log(scale)

        if p.get("attention_factor") is not None:
            att = p["attention_factor"]
        elif p.get("mscale") and p.get("mscale_all_dim"):
            att = temperature(factor, p["mscale"]) / temperature(factor, p["mscale_all_dim"])
        else:
            att = temperature(factor)

        # The pair index i at which a pair completes `turns` rotations over the
        # original context: orig * theta^(-2i/d) = 2 pi turns, solved for i.
        def pair_at(turns):
            return math.log(orig / (2.0 * math.pi * turns)) / math.log(theta) * d / 2.0

        lo, hi = pair_at(p.get("beta_fast", 32.0)), pair_at(p.get("beta_slow", 1.0))
        if p.get("truncate", True):
            lo, hi = math.floor(lo), math.ceil(hi)
        lo, hi = max(lo, 0), min(hi, d - 1)
        if hi == lo:
            hi = hi + 0.001
        out = []
        for j, w in zip(pairs, plain(theta)):
            t = min(1.0, max(0.0, (j - lo) / (hi - lo)))  # 0: keep w, 1: w / factor
            out.append((1.0 - t) * w + t * (w / factor))
        return out, att
    if kind == "llama3":
        orig = p["original_max_position_embeddings"]
        lf, hf = p.get("low_freq_factor", 1.0), p.get("high_freq_factor", 4.0)
        out = []
        for w in plain(theta):
            wavelength = 2.0 * math.pi / w
            if wavelength < orig / hf:  # high frequency: untouched
                out.append(w)
            elif wavelength > orig / lf:  # low frequency: interpolated
                out.append(w / p["factor"])
            else:  # in between: blend by how many wavelengths fit the original context
                a = (orig / wavelength - lf) / (hf - lf)
                out.append(a * w + (1.0 - a) * w / p["factor"])
        return out, 1.0
    if kind == "longrope":
        orig = p["original_max_position_embeddings"]
        if p.get("attention_factor") is not None:
            att = p["attention_factor"]
        else:
            factor = p.get("factor") or p["max_position_embeddings"] / orig
            att = 1.0 if factor <= 1 else math.sqrt(1.0 + math.log(factor) / math.log(orig))
        ext = p["long_factor"] if seq_len > orig else p["short_factor"]
        return [w / e for w, e in zip(plain(theta), ext)], att
    if kind == "proportional":  # Gemma 4: a share of the pairs turns, the rest stand still
        turning = math.floor(p.get("partial_rotary_factor", 1.0) * d / 2)
        factor = p.get("factor", 1.0)
        return [w / factor if j < turning else 0.0 for j, w in enumerate(plain(theta))], 1.0
    raise AssertionError(kind)
