#!/usr/bin/env python3
"""Tests of compare_attention.py on a hand-made pair of kernel-bench and SDPA files.

  python3 tests/bench/test_compare_attention.py      (Python 3 only; no torch, no GPU)
"""

import contextlib
import io
import json
import os
import sys
import tempfile
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import compare_attention  # noqa: E402

MHA = {"batch": 4, "heads_q": 16, "heads_kv": 16, "seq": 2048, "head_dim": 128, "causal": True}
GQA = {"batch": 2, "heads_q": 32, "heads_kv": 8, "seq": 2048, "head_dim": 128, "causal": True}
ONLY_OURS = {"batch": 8, "heads_q": 12, "heads_kv": 12, "seq": 2048, "head_dim": 64}


def kernel(name, ms, params=None, shape="(shape)"):
    r = {"name": name, "shape": shape, "median_ms": ms, "gbps": 0.0, "tflops": 1.0}
    if params is not None:
        r["params"] = params
    return r


KERNELS = {
    "device": "NVIDIA H100 80GB HBM3 (sm_90, 132 SMs, 79.1 GiB)",
    "results": [
        kernel("gemm_bf16", 0.2),  # not attention: ignored
        # An entry without params is matched by its shape text (files from older builds).
        kernel("attention_fwd_bf16", 2.0, shape="B=4 H=16 S=2048 D=128 causal"),
        kernel("attention_bwd_bf16", 6.0, shape="B=4 H=16 S=2048 D=128 causal"),
        kernel("attention_fwd_bf16", 1.0, GQA),
        kernel("attention_bwd_bf16", 2.0, GQA),
        # The one-pass backward: only --variant atomic_dq reads it.
        kernel("attention_bwd_atomic_dq_bf16", 1.6, GQA),
        # The one-key-m-tile form: only --variant one_key_mtile reads it.
        kernel("attention_bwd_one_key_mtile_bf16", 2.4, GQA),
        # And the one-pass backward's: only --variant atomic_dq_one_key_mtile reads it.
        kernel("attention_bwd_atomic_dq_one_key_mtile_bf16", 1.4, GQA),
        kernel("attention_fwd_bf16", 1.0, ONLY_OURS),
        kernel("attention_bwd_bf16", 3.0, ONLY_OURS),
    ],
}


def sdpa(params, backend, fwd, bwd, both):
    return {"params": params, "backend": backend, "forward_ms": fwd, "backward_ms": bwd,
            "forward_backward_ms": both}


SDPA = {
    "device": "NVIDIA H100 80GB HBM3",
    "torch": "2.11.0",
    "results": [
        sdpa(MHA, "default", 1.0, 2.0, 3.2),
        sdpa(MHA, "flash", 0.8, 1.5, 2.5),
        {"params": MHA, "backend": "cudnn", "error": "RuntimeError: no kernel"},
        sdpa(GQA, "default", 1.5, 1.0, 2.0),
        sdpa(GQA, "flash", 1.6, 0.9, 2.4),
    ],
}


def by(rows, shape, pass_name):
    [row] = [r for r in rows if r["shape"] == shape and r["pass"] == pass_name]
    return row


class CompareAttention(unittest.TestCase):
    def test_ratios_and_verdicts_against_the_default_backend(self):
        rows = compare_attention.compare(KERNELS, SDPA, "default", 0.5)
        self.assertEqual(len(rows), 9)  # 3 shapes x 3 passes
        fwd = by(rows, "B=4 H=16 S=2048 D=128", "forward")
        self.assertEqual(fwd["shardtrain_ms"], 2.0)
        self.assertEqual(fwd["sdpa_ms"], 1.0)
        self.assertAlmostEqual(fwd["ratio"], 0.5)
        self.assertEqual(fwd["status"], "PASS")  # exactly half SDPA's speed passes
        bwd = by(rows, "B=4 H=16 S=2048 D=128", "backward")
        self.assertAlmostEqual(bwd["ratio"], 2.0 / 6.0)
        self.assertEqual(bwd["status"], "FAIL")
        both = by(rows, "B=4 H=16 S=2048 D=128", "forward+backward")
        self.assertEqual(both["shardtrain_ms"], 8.0)  # forward + backward
        self.assertAlmostEqual(both["ratio"], 3.2 / 8.0)
        self.assertEqual(both["status"], "FAIL")
        g = by(rows, "B=2 Hq=32 Hkv=8 S=2048 D=128", "forward")
        self.assertAlmostEqual(g["ratio"], 1.5)
        self.assertEqual(g["status"], "PASS")
        self.assertAlmostEqual(by(rows, "B=2 Hq=32 Hkv=8 S=2048 D=128", "backward")["ratio"], 0.5)
        missing = by(rows, "B=8 H=12 S=2048 D=64", "forward")
        self.assertEqual(missing["status"], "MISSING")
        self.assertIsNone(missing["ratio"])

    def test_best_takes_the_fastest_backend_that_ran(self):
        rows = compare_attention.compare(KERNELS, SDPA, "best", 0.5)
        fwd = by(rows, "B=4 H=16 S=2048 D=128", "forward")
        self.assertEqual(fwd["sdpa_ms"], 0.8)
        self.assertEqual(fwd["sdpa_backend"], "flash")
        self.assertAlmostEqual(fwd["ratio"], 0.4)
        self.assertEqual(fwd["status"], "FAIL")
        gb = by(rows, "B=2 Hq=32 Hkv=8 S=2048 D=128", "forward+backward")
        self.assertEqual(gb["sdpa_ms"], 2.0)
        self.assertEqual(gb["sdpa_backend"], "default")

    def test_variant_picks_the_backward_rows(self):
        rows = compare_attention.compare(KERNELS, SDPA, "default", 0.5, "atomic_dq")
        g = by(rows, "B=2 Hq=32 Hkv=8 S=2048 D=128", "backward")
        self.assertEqual(g["shardtrain_ms"], 1.6)
        self.assertAlmostEqual(g["ratio"], 1.0 / 1.6)
        self.assertEqual(g["status"], "PASS")
        self.assertEqual(by(rows, "B=2 Hq=32 Hkv=8 S=2048 D=128", "forward+backward")
                         ["shardtrain_ms"], 2.6)
        # The forward is the same row for both variants; a shape without a one-pass figure has
        # no backward.
        self.assertEqual(by(rows, "B=2 Hq=32 Hkv=8 S=2048 D=128", "forward")["shardtrain_ms"],
                         1.0)
        self.assertEqual(by(rows, "B=4 H=16 S=2048 D=128", "backward")["status"], "MISSING")
        # The default variant never reads the one-pass rows.
        self.assertEqual(by(compare_attention.compare(KERNELS, SDPA), "B=2 Hq=32 Hkv=8 S=2048 D=128",
                            "backward")["shardtrain_ms"], 2.0)

    def test_one_key_mtile_variant(self):
        rows = compare_attention.compare(KERNELS, SDPA, "default", 0.5, "one_key_mtile")
        self.assertEqual(by(rows, "B=2 Hq=32 Hkv=8 S=2048 D=128", "backward")["shardtrain_ms"], 2.4)
        self.assertEqual(by(rows, "B=4 H=16 S=2048 D=128", "backward")["status"], "MISSING")
        rows = compare_attention.compare(KERNELS, SDPA, "default", 0.5, "atomic_dq_one_key_mtile")
        self.assertEqual(by(rows, "B=2 Hq=32 Hkv=8 S=2048 D=128", "backward")["shardtrain_ms"], 1.4)
        for variant, ms in (("deterministic", 2.0), ("atomic_dq", 1.6), ("one_key_mtile", 2.4)):
            self.assertEqual(by(compare_attention.compare(KERNELS, SDPA, "default", 0.5, variant),
                                "B=2 Hq=32 Hkv=8 S=2048 D=128", "backward")["shardtrain_ms"], ms)

    def test_row_names(self):
        self.assertEqual(compare_attention.pass_of("attention_fwd_bf16", "atomic_dq"), "forward")
        self.assertEqual(compare_attention.pass_of("attention_bwd_bf16", "deterministic"),
                         "backward")
        self.assertIsNone(compare_attention.pass_of("attention_bwd_atomic_dq_bf16", "deterministic"))
        self.assertIsNone(compare_attention.pass_of("attention_bwd_one_key_mtile_bf16",
                                                    "atomic_dq"))
        self.assertIsNone(compare_attention.pass_of("attention_bwd_atomic_dq_one_key_mtile_bf16",
                                                    "one_key_mtile"))
        self.assertEqual(compare_attention.pass_of("attention_bwd_atomic_dq_one_key_mtile_bf16",
                                                   "atomic_dq_one_key_mtile"), "backward")
        self.assertIsNone(compare_attention.pass_of("rmsnorm_bwd_bf16", "deterministic"))

    def test_target(self):
        rows = compare_attention.compare(KERNELS, SDPA, "default", 0.3)
        self.assertEqual(by(rows, "B=4 H=16 S=2048 D=128", "backward")["status"], "PASS")

    def test_main_prints_the_table_and_sets_the_exit_status(self):
        with tempfile.TemporaryDirectory() as d:
            k, s, out = (os.path.join(d, n) for n in ("k.json", "s.json", "cmp.json"))
            with open(k, "w") as f:
                json.dump(KERNELS, f)
            with open(s, "w") as f:
                json.dump(SDPA, f)
            text = io.StringIO()
            with contextlib.redirect_stdout(text):
                code = compare_attention.main([k, s, "--json", out])
            self.assertEqual(code, 1)  # failures and missing figures
            printed = text.getvalue()
            self.assertIn("| B=4 H=16 S=2048 D=128 | forward | 2.000 | 1.000 | default | 0.50x | "
                          "PASS |", printed)
            self.assertIn("| B=8 H=12 S=2048 D=64 | forward | 1.000 | - | default | - | MISSING |",
                          printed)
            self.assertIn("4 pass, 2 fail, 3 missing", printed)
            with open(out) as f:
                self.assertEqual(len(json.load(f)["rows"]), 9)

            # Every row passing: exit 0. A shape on one side only is missing, not passing.
            for path, data in ((k, KERNELS), (s, SDPA)):
                with open(path, "w") as f:
                    gqa_only = [r for r in data["results"] if r.get("params") == GQA]
                    json.dump({"results": gqa_only}, f)
            with contextlib.redirect_stdout(io.StringIO()):
                self.assertEqual(compare_attention.main([k, s]), 0)

            with contextlib.redirect_stderr(io.StringIO()):
                self.assertEqual(compare_attention.main([k, os.path.join(d, "none.json")]), 2)


if __name__ == "__main__":
    unittest.main()
