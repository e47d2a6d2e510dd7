#!/usr/bin/env python3
"""Compares shardtrain's fused attention with PyTorch's scaled_dot_product_attention.

Reads the JSON of `shardtrain-kernel-bench --json` and of tests/bench/sdpa_reference.py, matches
their attention results by shape (batch, heads_q, heads_kv, seq, head_dim), and prints one row per
shape and pass (forward, backward, forward+backward): shardtrain ms, SDPA ms, the speed ratio
SDPA ms / shardtrain ms (1.0 = as fast as SDPA, 0.5 = half its speed) and PASS when the ratio is at
least the target (default 0.5: shardtrain at least half as fast as SDPA). shardtrain's
forward+backward is its forward plus its backward median. --variant picks which of shardtrain's
backward forms is compared: deterministic (rows attention_bwd_<dtype>, the default), atomic_dq
(rows attention_bwd_atomic_dq_<dtype>), one_key_mtile (rows attention_bwd_one_key_mtile_<dtype>:
the deterministic backward with one 16-key m-tile a warp in its dK/dV kernel, head dim 64 only)
or atomic_dq_one_key_mtile (the same for the one-pass backward).

  python3 tests/bench/compare_attention.py kernels.json sdpa.json
  python3 tests/bench/compare_attention.py kernels.json sdpa.json --backend best --json cmp.json

Exit status: 0 when every row passes, 1 when any fails or has no figure on one side, 2 when an
input cannot be read. Needs nothing but Python 3.
"""

import argparse
import json
import re
import sys

PASSES = (("forward", "fwd"), ("backward", "bwd"), ("forward+backward", "fwd+bwd"))


def shape_key(params):
    return (int(params["batch"]), int(params["heads_q"]), int(params["heads_kv"]),
            int(params["seq"]), int(params["head_dim"]))


def key_from_text(shape):
    """The key of a kernel-bench shape string such as 'B=4 H=16 S=2048 D=128 causal' (for files
    written before the results carried their params)."""
    fields = dict(re.findall(r"(\w+)=(\d+)", shape))
    try:
        hq = int(fields.get("Hq", fields.get("H")))
        hkv = int(fields.get("Hkv", hq))
        return (int(fields["B"]), hq, hkv, int(fields["S"]), int(fields["D"]))
    except (KeyError, TypeError, ValueError):
        return None


# shardtrain's backward forms and the part of the kernel-bench row name between attention_bwd_ and
# the dtype: attention_bwd_bf16, attention_bwd_atomic_dq_bf16, attention_bwd_one_key_mtile_bf16
# and attention_bwd_atomic_dq_one_key_mtile_bf16 (the dK/dV kernel with one key m-tile a warp,
# timed at head dim 64 only).
VARIANTS = {"deterministic": "", "atomic_dq": "atomic_dq_", "one_key_mtile": "one_key_mtile_",
            "atomic_dq_one_key_mtile": "atomic_dq_one_key_mtile_"}
BACKWARD_ROW = re.compile(r"attention_bwd_(?P<form>(?:[a-z0-9]+_)*?)(?P<dtype>bf16|f16|fp16|f32)")


def pass_of(name, variant):
    """'forward' or 'backward' for a kernel-bench row name of the chosen backward variant, None
    for other rows (another variant's backward, other kernels)."""
    if name.startswith("attention_fwd"):
        return "forward"
    m = BACKWARD_ROW.fullmatch(name)
    if m and m.group("form") == VARIANTS[variant]:
        return "backward"
    return None


def shardtrain_times(data, variant="deterministic"):
    """{shape key: {"forward": ms, "backward": ms, "forward+backward": ms}} of a kernel bench,
    with the backward of `variant`."""
    out = {}
    for r in data.get("results", []):
        which = pass_of(r.get("name", ""), variant)
        if which is None:
            continue
        key = shape_key(r["params"]) if r.get("params") else key_from_text(r.get("shape", ""))
        if key is not None:
            out.setdefault(key, {})[which] = float(r["median_ms"])
    for times in out.values():
        if "forward" in times and "backward" in times:
            times["forward+backward"] = times["forward"] + times["backward"]
    return out


def sdpa_times(data, backend):
    """{shape key: ({"forward": ms, ...}, backend used)} of an sdpa_reference.py file. backend
    'best' takes, per shape and pass, the fastest backend that ran."""
    field = {"forward": "forward_ms", "backward": "backward_ms",
             "forward+backward": "forward_backward_ms"}
    out = {}
    for r in data.get("results", []):
        if "error" in r or not r.get("params"):
            continue
        if backend != "best" and r.get("backend") != backend:
            continue
        key = shape_key(r["params"])
        times, used = out.setdefault(key, ({}, {}))
        for name, f in field.items():
            if f not in r:
                continue
            ms = float(r[f])
            if name not in times or ms < times[name]:
                times[name] = ms
                used[name] = r.get("backend", "?")
    return out


def shape_text(key):
    b, hq, hkv, s, d = key
    heads = f"H={hq}" if hq == hkv else f"Hq={hq} Hkv={hkv}"
    return f"B={b} {heads} S={s} D={d}"


def compare(kernels, sdpa, backend="default", target=0.5, variant="deterministic"):
    """The comparison rows: dicts with shape, pass, shardtrain_ms, sdpa_ms, sdpa_backend,
    ratio (SDPA ms / shardtrain ms) and status PASS, FAIL or MISSING."""
    ours = shardtrain_times(kernels, variant)
    ref = sdpa_times(sdpa, backend)
    rows = []
    for key in list(ours) + [k for k in ref if k not in ours]:
        mine = ours.get(key, {})
        theirs, used = ref.get(key, ({}, {}))
        for name, _ in PASSES:
            row = {"shape": shape_text(key), "params": dict(zip(
                       ("batch", "heads_q", "heads_kv", "seq", "head_dim"), key)),
                   "pass": name, "shardtrain_ms": mine.get(name), "sdpa_ms": theirs.get(name),
                   "sdpa_backend": used.get(name, backend), "ratio": None, "status": "MISSING"}
            if row["shardtrain_ms"] and row["sdpa_ms"]:
                row["ratio"] = row["sdpa_ms"] / row["shardtrain_ms"]
                row["status"] = "PASS" if row["ratio"] >= target else "FAIL"
            rows.append(row)
    return rows


def table(rows, target):
    def ms(v):
        return f"{v:.3f}" if v else "-"

    lines = [
        "| shape | pass | shardtrain ms | SDPA ms | SDPA backend | speed vs SDPA "
        f"| >= {target:g}x |",
        "|---|---|---:|---:|---|---:|---|",
    ]
    for r in rows:
        ratio = f"{r['ratio']:.2f}x" if r["ratio"] is not None else "-"
        lines.append(f"| {r['shape']} | {r['pass']} | {ms(r['shardtrain_ms'])} | "
                     f"{ms(r['sdpa_ms'])} | {r['sdpa_backend']} | {ratio} | {r['status']} |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("kernels", help="shardtrain-kernel-bench --json output")
    ap.add_argument("sdpa", help="sdpa_reference.py --json output")
    ap.add_argument("--backend", default="default",
                    help="SDPA backend to compare with: default (PyTorch's own choice), flash, "
                         "cudnn, efficient, or best (the fastest per shape and pass)")
    ap.add_argument("--target", type=float, default=0.5,
                    help="the least speed ratio that passes (default 0.5)")
    ap.add_argument("--variant", choices=list(VARIANTS), default="deterministic",
                    help="shardtrain's backward form to compare (default deterministic)")
    ap.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    args = ap.parse_args(argv)

    data = []
    for path in (args.kernels, args.sdpa):
        try:
            with open(path) as f:
                data.append(json.load(f))
        except (OSError, ValueError) as e:
            print(f"compare_attention: cannot read {path}: {e}", file=sys.stderr)
            return 2
    rows = compare(data[0], data[1], args.backend, args.target, args.variant)
    if not rows:
        print("compare_attention: no attention results in either file", file=sys.stderr)
        return 2
    print(f"shardtrain ({data[0].get('device', '?')}) against PyTorch SDPA "
          f"({data[1].get('device', '?')}, torch {data[1].get('torch', '?')}, backend "
          f"{args.backend}); causal bf16; shardtrain backward {args.variant}; "
          f"speed = SDPA ms / shardtrain ms")
    print()
    print(table(rows, args.target))
    counts = {s: sum(r["status"] == s for r in rows) for s in ("PASS", "FAIL", "MISSING")}
    print()
    print(f"compare_attention: {counts['PASS']} pass, {counts['FAIL']} fail, "
          f"{counts['MISSING']} missing (target: at least {args.target:g}x SDPA's speed)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"backend": args.backend, "target": args.target,
                       "variant": args.variant, "rows": rows}, f,
                      indent=2)
            f.write("\n")
    return 0 if counts["FAIL"] == 0 and counts["MISSING"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
