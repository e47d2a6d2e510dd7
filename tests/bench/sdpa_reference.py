#!/usr/bin/env python3
"""Times PyTorch's scaled_dot_product_attention on the attention shapes of shardtrain-kernel-bench.

The reference for shardtrain's fused attention (kernels/flash_attention.cu): causal, bf16,
q [B, Hq, S, D] and k, v [B, Hkv, S, D] (grouped-query when Hkv < Hq), scale 1/sqrt(D), the same
layout and arguments as Backend::attention_forward/backward. For every shape and SDPA backend it
times, between CUDA events after warm-up runs, the median of N runs of

  forward           out = sdpa(q, k, v) with autograd recording (it saves what backward needs,
                    as shardtrain's forward saves its log-sum-exp)
  backward          torch.autograd.grad(out, (q, k, v), dout) of one recorded forward
  forward_backward  both, as one training step's attention does

and writes JSON that tests/bench/compare_attention.py reads next to the kernel bench's.

  python3 tests/bench/sdpa_reference.py --shapes-from kernels.json --json sdpa.json
  python3 tests/bench/sdpa_reference.py --json sdpa.json          # the built-in shape list

Rates use the kernel bench's FLOP counts: forward 4*B*Hq*S*S*D/2 (the causal half of two
S x S x D products per head), backward 2.5 times that. Needs Python 3 and torch with CUDA only.
Correctness of shardtrain's kernels is tested elsewhere (tests/cuda/attention.cpp); this script
only measures the reference.
"""

import argparse
import json
import math
import statistics
import sys
import time

# The shapes of tests/bench/kernel_bench.cpp (kAttentionShapes), used when no kernel-bench JSON
# is given: (batch, heads_q, heads_kv, seq, head_dim). Keep the two lists equal.
DEFAULT_SHAPES = [
    (4, 16, 16, 2048, 128),
    (2, 32, 8, 2048, 128),
    (1, 32, 8, 2048, 64),
    (4, 32, 8, 2048, 64),
    (8, 32, 8, 2048, 64),
    (8, 12, 12, 2048, 64),
]

BACKENDS = ("default", "flash", "cudnn", "efficient")


def shapes_from_kernel_bench(path):
    """The attention shapes of a shardtrain-kernel-bench --json file, in its order."""
    with open(path) as f:
        data = json.load(f)
    shapes = []
    for r in data.get("results", []):
        p = r.get("params")
        if not r.get("name", "").startswith("attention_") or not p:
            continue
        shape = (p["batch"], p["heads_q"], p["heads_kv"], p["seq"], p["head_dim"])
        if shape not in shapes:
            shapes.append(shape)
    return shapes


def shape_text(shape):
    b, hq, hkv, s, d = shape
    heads = f"H={hq}" if hq == hkv else f"Hq={hq} Hkv={hkv}"
    return f"B={b} {heads} S={s} D={d} causal"


def forward_flops(shape):
    b, hq, _, s, d = shape
    return 4.0 * b * hq * s * s * d / 2.0


def median_ms(torch, fn, warmup, iters):
    """Median of `iters` timed calls of fn (each between its own pair of CUDA events)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    events = []
    for _ in range(iters):
        start = torch.cuda.Event(enable_timing=True)
        stop = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        events.append((start, stop))
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in events)


def backend_context(torch, name):
    """A context manager that restricts SDPA to one backend (none for 'default')."""
    import contextlib

    if name == "default":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    kind = {
        "flash": SDPBackend.FLASH_ATTENTION,
        "cudnn": SDPBackend.CUDNN_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
    }[name]
    return sdpa_kernel(kind)


def time_shape(torch, shape, backend, warmup, iters):
    import torch.nn.functional as F

    b, hq, hkv, s, d = shape
    dev, dt = "cuda", torch.bfloat16
    gen = torch.Generator(device=dev).manual_seed(1234)
    q = torch.randn(b, hq, s, d, device=dev, dtype=dt, generator=gen, requires_grad=True)
    k = torch.randn(b, hkv, s, d, device=dev, dtype=dt, generator=gen, requires_grad=True)
    v = torch.randn(b, hkv, s, d, device=dev, dtype=dt, generator=gen, requires_grad=True)
    dout = torch.randn(b, hq, s, d, device=dev, dtype=dt, generator=gen)
    scale = 1.0 / math.sqrt(d)
    gqa = "none" if hq == hkv else "native"

    def sdpa():
        if gqa == "native":
            return F.scaled_dot_product_attention(
                q, k, v, is_causal=True, scale=scale, enable_gqa=True
            )
        if gqa == "expanded":
            return F.scaled_dot_product_attention(q, k_full, v_full, is_causal=True, scale=scale)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)

    k_full = v_full = None
    with backend_context(torch, backend):
        try:
            sdpa()
        except TypeError:
            # A torch without enable_gqa: repeat the kv heads once, outside the timed region.
            if gqa != "native":
                raise
            gqa = "expanded"
            k_full = k.detach().repeat_interleave(hq // hkv, dim=1).requires_grad_()
            v_full = v.detach().repeat_interleave(hq // hkv, dim=1).requires_grad_()
            sdpa()
        inputs = (q, k_full, v_full) if gqa == "expanded" else (q, k, v)
        fwd = median_ms(torch, sdpa, warmup, iters)
        out = sdpa()
        bwd = median_ms(
            torch,
            lambda: torch.autograd.grad(out, inputs, dout, retain_graph=True),
            warmup,
            iters,
        )
        del out
        both = median_ms(torch, lambda: torch.autograd.grad(sdpa(), inputs, dout), warmup, iters)
    flops = forward_flops(shape)
    return {
        "gqa": gqa,
        "forward_ms": fwd,
        "backward_ms": bwd,
        "forward_backward_ms": both,
        "forward_tflops": flops / (fwd * 1e-3) * 1e-12,
        "backward_tflops": 2.5 * flops / (bwd * 1e-3) * 1e-12,
        "forward_backward_tflops": 3.5 * flops / (both * 1e-3) * 1e-12,
    }


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes-from", metavar="KERNELS.json",
                    help="take the attention shapes from shardtrain-kernel-bench --json output "
                         "(default: the built-in list, equal to kernel_bench.cpp's)")
    ap.add_argument("--json", metavar="PATH", help="write the results here")
    ap.add_argument("--iters", type=int, default=20, help="timed runs per figure (median)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed runs before each figure")
    ap.add_argument("--backends", default=",".join(BACKENDS),
                    help="SDPA backends to time, comma-separated: default (PyTorch's own choice), "
                         "flash, cudnn, efficient (default: all)")
    args = ap.parse_args(argv)
    backends = [b for b in args.backends.split(",") if b]
    for b in backends:
        if b not in BACKENDS:
            ap.error(f"--backends: unknown backend '{b}'; expected some of {','.join(BACKENDS)}")
    if args.iters < 1 or args.warmup < 0:
        ap.error("--iters must be at least 1 and --warmup at least 0")

    shapes = DEFAULT_SHAPES
    if args.shapes_from:
        try:
            shapes = shapes_from_kernel_bench(args.shapes_from)
        except (OSError, ValueError, KeyError) as e:
            print(f"sdpa_reference: cannot read shapes from {args.shapes_from}: {e}; "
                  "using the built-in list", file=sys.stderr)
            shapes = DEFAULT_SHAPES
        if not shapes:
            print(f"sdpa_reference: no attention results with params in {args.shapes_from}; "
                  "using the built-in list", file=sys.stderr)
            shapes = DEFAULT_SHAPES

    try:
        import torch
    except ImportError as e:
        print(f"sdpa_reference: PyTorch is not importable with {sys.executable} ({e})",
              file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("sdpa_reference: no CUDA device (torch.cuda.is_available() is False)",
              file=sys.stderr)
        return 2
    props = torch.cuda.get_device_properties(0)
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    print(f"device: {props.name}; torch {torch.__version__}, CUDA {torch.version.cuda}, "
          f"cuDNN {cudnn}; median of {args.iters} after {args.warmup} warm-up runs", flush=True)
    print(f"{'shape':<36} {'backend':<10} {'fwd ms':>9} {'bwd ms':>9} {'fwd+bwd ms':>11} "
          f"{'fwd TFLOP/s':>12} {'bwd TFLOP/s':>12}", flush=True)

    results = []
    for shape in shapes:
        b, hq, hkv, s, d = shape
        params = {"batch": b, "heads_q": hq, "heads_kv": hkv, "seq": s, "head_dim": d,
                  "causal": True, "dtype": "bf16"}
        for backend in backends:
            entry = {"params": params, "shape": shape_text(shape), "backend": backend}
            start = time.time()
            try:
                entry.update(time_shape(torch, shape, backend, args.warmup, args.iters))
                print(f"{shape_text(shape):<36} {backend:<10} {entry['forward_ms']:9.3f} "
                      f"{entry['backward_ms']:9.3f} {entry['forward_backward_ms']:11.3f} "
                      f"{entry['forward_tflops']:12.1f} {entry['backward_tflops']:12.1f}",
                      flush=True)
            except Exception as e:  # an unavailable backend for this shape: record, go on
                entry["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                print(f"{shape_text(shape):<36} {backend:<10} not available: {entry['error']}",
                      flush=True)
            entry["seconds"] = round(time.time() - start, 3)
            results.append(entry)
            torch.cuda.empty_cache()

    report = {
        "device": props.name,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": cudnn,
        "iters": args.iters,
        "warmup": args.warmup,
        "flops_convention": "forward 4*B*Hq*S*S*D/2, backward 2.5x forward (kernel_bench.cpp)",
        "results": results,
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
            f.write("\n")
        print(f"wrote {args.json}")
    ok = [r for r in results if "error" not in r]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
