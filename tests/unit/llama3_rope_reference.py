"""Llama-3 RoPE inverse frequencies in float64 with the standard library only.

The formula of Hugging Face transformers' _compute_llama3_parameters (modeling_rope_utils.py),
written independently of the C++ code; its output is hard-coded in
tests/unit/test_cpu_backend.cpp (RopeFrequencies.*). Run: python3 llama3_rope_reference.py
"""
import math


def inv_freq(dim, theta, factor=None, low=1.0, high=4.0, original=8192):
    freqs = [1.0 / theta ** (2 * i / dim) for i in range(dim // 2)]
    if factor is None:
        return freqs
    low_wavelen = original / low
    high_wavelen = original / high
    out = []
    for f in freqs:
        wavelen = 2 * math.pi / f
        if wavelen < high_wavelen:
            out.append(f)
        elif wavelen > low_wavelen:
            out.append(f / factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            out.append((1 - smooth) * f / factor + smooth * f)
    return out


CASES = {
    "llama31_8b": dict(dim=128, theta=500000.0, factor=8.0, low=1.0, high=4.0, original=8192),
    "llama32_1b": dict(dim=64, theta=500000.0, factor=32.0, low=1.0, high=4.0, original=8192),
    "odd_factors": dict(dim=16, theta=10000.0, factor=3.0, low=0.5, high=2.5, original=100),
}

if __name__ == "__main__":
    for name, case in CASES.items():
        values = inv_freq(**case)
        print(f"// {name}: {case}")
        for i in range(0, len(values), 4):
            print("    " + ", ".join(f"{v:.17g}" for v in values[i:i + 4]) + ",")
