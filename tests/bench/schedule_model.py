#!/usr/bin/env python3
"""A list-scheduling model of the fused attention kernels' block order on a GPU.

The figures quoted in kernels/launch_order.h and docs/cuda.md come from this model, not from a
GPU. Each kernel's blocks are handed, in launch order, to the first free of `slots` slots (two
per SM); a block occupies its slot for as long as its tiles (the forward and dQ: key tiles up to
the diagonal; dK/dV: query tiles from its keys on, for each query head it walks). The model
leaves out that a block alone on an SM runs faster, and all memory effects.

It compares the old order (each unit's blocks in a row, longest first within the unit for the
forward and dQ) with the launcher's longest-first order in chunks (kernels/flash_attention.cu:
longest_first, group_split), on the kernel bench's shapes.

  python3 tests/bench/schedule_model.py [--sms 132]
"""

import argparse
import heapq

SHAPES = [(4, 16, 16, 2048, 128), (2, 32, 8, 2048, 128), (1, 32, 8, 2048, 64),
          (4, 32, 8, 2048, 64), (8, 32, 8, 2048, 64), (8, 12, 12, 2048, 64)]
L2_SHARE = 20 << 20  # kL2Share
MIN_WAVES = 4        # kMinWaves


def makespan(durations, slots):
    free = [0.0] * slots
    for d in durations:
        heapq.heappush(free, heapq.heappop(free) + d)
    return max(free)


def in_a_row(ranks, units, work):
    return [work(r, u) for u in range(units) for r in range(ranks)]


def longest_first(ranks, units, chunk, work):
    out = []
    for first in range(0, units, chunk):
        for r in range(ranks):
            out.extend(work(r, u) for u in range(first, min(units, first + chunk)))
    return out


def chunk_units(ranks, units, unit_bytes, slots):
    by_l2 = L2_SHARE // max(unit_bytes, 1)
    by_waves = -(-MIN_WAVES * slots // ranks)
    return max(1, min(units, max(by_l2, by_waves)))


def group_split(b, hq, hkv, s, block_keys, tile_rows, slots):
    group = hq // hkv
    q_tiles = -(-s // tile_rows)
    head_steps = sum(q_tiles - kb * block_keys // tile_rows for kb in range(-(-s // block_keys)))
    share = b * hq * head_steps // slots
    for split in range(1, group):
        if group % split == 0 and (group // split) * q_tiles <= share:
            return split
    return group


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sms", type=int, default=132, help="SMs of the GPU (H100 SXM: 132)")
    args = ap.parse_args()
    slots = 2 * args.sms
    print(f"{'shape':<28} {'forward':>8} {'dQ':>8} {'dK/dV':>8}   (old order's end / new order's)")
    for b, hq, hkv, s, d in SHAPES:
        group = hq // hkv
        gains = []
        # Forward (128 rows, 64-key tiles) and dQ (64 rows and 64-key tiles at D=64, 128 and 32
        # at D=128); rank r is tile ranks - 1 - r. Units: [B, Hq] heads sharing K and V.
        for rows, keys in ((128, 64), (64, 64) if d == 64 else (128, 32)):
            ranks = -(-s // rows)
            work = lambda r, u, ranks=ranks, rows=rows, keys=keys: \
                ((ranks - 1 - r) * rows + rows - 1) // keys + 1
            units = b * hq
            chunk = chunk_units(ranks, units, s * d * 4 // group, slots)
            gains.append(makespan(in_a_row(ranks, units, work), slots) /
                         makespan(longest_first(ranks, units, chunk, work), slots))
        # dK/dV: 128 keys a block at D=64 (two m-tiles a warp), 64 at D=128; query tiles of 32.
        block_keys, tile_rows = (128 if d == 64 else 64), 32
        split = group_split(b, hq, hkv, s, block_keys, tile_rows, slots)
        ranks, units = -(-s // block_keys), b * hkv * split
        work = lambda r, u: (group // split) * (-(-s // tile_rows) - r * block_keys // tile_rows)
        chunk = chunk_units(ranks, units, s * d * 4 * (group // split), slots)
        gains.append(makespan(in_a_row(ranks, units, work), slots) /
                     makespan(longest_first(ranks, units, chunk, work), slots))
        shape = f"B={b} Hq={hq} Hkv={hkv} S={s} D={d}"
        print(f"{shape:<28} {gains[0]:>7.2f}x {gains[1]:>7.2f}x {gains[2]:>7.2f}x")


if __name__ == "__main__":
    main()
