# Mirror of flash_forward_kernel (stage 1: 8 warps x 16 rows, Q in registers, ldmatrix,
# double-buffered cp.async K/V, mask only where needed).
import math
import numpy as np
from core import *

MUT = set()  # mutation switches for the mutation check
FWD_WARPS = 8


def forward(qf_, kf_, vf_, B, Hq, Hkv, S, D, scale, dtype):
    NW = FWD_WARPS; NT = 32 * NW; BR = 16 * NW; BC = 64; LD = D + 8; STAGE = BC * LD
    n = BR * LD + 4 * STAGE
    ksmem = 2 * n
    assert ksmem == 2 * (BR * LD + 4 * STAGE)
    assert ksmem <= 163 * 1024, ksmem
    QS, KS, VS = 0, BR * LD, BR * LD + 2 * STAGE
    group = Hq // Hkv
    sl2 = np.float32(scale * LOG2E)
    out = np.full(B * Hq * S * D, np.nan, np.float32)
    lse = np.full(B * Hq * S, np.nan, np.float32)
    gx = -(-S // BR)
    for b in range(B):
        for h in range(Hq):
            for bx in range(gx):
                tile = gx - 1 - bx
                head = b * Hq + h; kvh = b * Hkv + h // group
                qb, kb, vb = head * S * D, kvh * S * D, kvh * S * D
                q0 = tile * BR
                tiles = (min(q0 + BR, S) - 1) // BC + 1
                sm = Smem(n, 2, NW, {'qs': (QS, KS), 'k0': (KS, KS + STAGE), 'k1': (KS + STAGE, VS),
                                     'v0': (VS, VS + STAGE), 'v1': (VS + STAGE, n)})
                blk = Block(NW, sm)
                for w in range(NW):
                    copy_rows_async(sm, w, QS, qf_, qb, q0, S, BR, D, LD, NT)
                    copy_rows_async(sm, w, KS, kf_, kb, 0, S, BC, D, LD, NT)
                    copy_rows_async(sm, w, VS, vf_, vb, 0, S, BC, D, LD, NT)
                    sm.commit(w)
                lr = lanes & 7; lm = lanes >> 3
                W = []
                for w in range(NW):
                    W.append(dict(qf=None, m_a=np.full(32, -np.inf, np.float32), m_b=np.full(32, -np.inf, np.float32),
                                  l_a=np.zeros(32, np.float32), l_b=np.zeros(32, np.float32),
                                  o=np.zeros((D // 8, 32, 4), np.float32)))
                for kt in range(tiles):
                    for w in range(NW):
                        if 'nowait' not in MUT:
                            sm.wait_all(w)
                        if 'early_prefetch' in MUT and kt + 1 < tiles:
                            nxt = (kt + 1) & 1
                            copy_rows_async(sm, w, KS + nxt * STAGE, kf_, kb, (kt + 1) * BC, S, BC, D, LD, NT)
                            copy_rows_async(sm, w, VS + nxt * STAGE, vf_, vb, (kt + 1) * BC, S, BC, D, LD, NT)
                            sm.commit(w)
                    if 'nosync' not in MUT:
                        blk.sync()
                    for w in range(NW):
                        st = W[w]
                        if kt + 1 < tiles and 'early_prefetch' not in MUT:
                            nxt = (kt + 1) & 1
                            if 'samestage' in MUT:
                                nxt = kt & 1
                            copy_rows_async(sm, w, KS + nxt * STAGE, kf_, kb, (kt + 1) * BC, S, BC, D, LD, NT)
                            copy_rows_async(sm, w, VS + nxt * STAGE, vf_, vb, (kt + 1) * BC, S, BC, D, LD, NT)
                            sm.commit(w)
                        if kt == 0:
                            st['qf'] = [sm.ldmatrix(w, QS + (w * 16 + (lm & 1) * 8 + lr) * LD + kc * 16 + (lm >> 1) * 8, 4, False)
                                        for kc in range(D // 16)]
                        k0 = kt * BC
                        warp_row0 = q0 + w * 16
                        row_a = warp_row0 + G; row_b = row_a + 8
                        if warp_row0 >= S or k0 > warp_row0 + 15:
                            continue
                        kst = KS + (kt & 1) * STAGE; vst = VS + (kt & 1) * STAGE
                        s = np.zeros((BC // 8, 32, 4), np.float32)
                        for kc in range(D // 16):
                            for np_ in range(BC // 16):
                                if 'kaddr' in MUT:
                                    addr = kst + (np_ * 16 + (lm & 1) * 8 + lr) * LD + kc * 16 + (lm >> 1) * 8
                                else:
                                    addr = kst + (np_ * 16 + (lm >> 1) * 8 + lr) * LD + kc * 16 + (lm & 1) * 8
                                kf = sm.ldmatrix(w, addr, 4, False)
                                mma(s[2 * np_], st['qf'][kc], kf[:, 0:2])
                                mma(s[2 * np_ + 1], st['qf'][kc], kf[:, 2:4])
                        need = (k0 + BC - 1 > warp_row0) or (k0 + BC > S)
                        if 'nomask' in MUT:
                            need = (k0 + BC > S)
                        if need:
                            for nt in range(BC // 8):
                                for e in range(4):
                                    key = k0 + nt * 8 + 2 * T4 + (e & 1)
                                    row = row_a if e < 2 else row_b
                                    s[nt, :, e] = np.where((key > row) | (key >= S), -np.inf, s[nt, :, e])
                        mx_a = np.full(32, -np.inf, np.float32); mx_b = mx_a.copy()
                        for nt in range(BC // 8):
                            mx_a = np.fmax(mx_a, np.fmax(s[nt, :, 0], s[nt, :, 1]))
                            mx_b = np.fmax(mx_b, np.fmax(s[nt, :, 2], s[nt, :, 3]))
                        new_a = np.fmax(st['m_a'], (quad_max(mx_a) * sl2).astype(np.float32))
                        new_b = np.fmax(st['m_b'], (quad_max(mx_b) * sl2).astype(np.float32))
                        base_a = np.where(new_a == -np.inf, np.float32(0), new_a)
                        base_b = np.where(new_b == -np.inf, np.float32(0), new_b)
                        with np.errstate(invalid='raise'):
                            alpha_a = np.exp2(st['m_a'] - base_a).astype(np.float32)
                            alpha_b = np.exp2(st['m_b'] - base_b).astype(np.float32)
                        st['m_a'], st['m_b'] = new_a, new_b
                        sum_a = np.zeros(32, np.float32); sum_b = np.zeros(32, np.float32)
                        with np.errstate(invalid='raise'):
                            for nt in range(BC // 8):
                                s[nt, :, 0] = np.exp2(fmaf(s[nt, :, 0], sl2, -base_a))
                                s[nt, :, 1] = np.exp2(fmaf(s[nt, :, 1], sl2, -base_a))
                                s[nt, :, 2] = np.exp2(fmaf(s[nt, :, 2], sl2, -base_b))
                                s[nt, :, 3] = np.exp2(fmaf(s[nt, :, 3], sl2, -base_b))
                                sum_a = (sum_a + (s[nt, :, 0] + s[nt, :, 1])).astype(np.float32)
                                sum_b = (sum_b + (s[nt, :, 2] + s[nt, :, 3])).astype(np.float32)
                        st['l_a'] = (st['l_a'] * alpha_a + sum_a).astype(np.float32)
                        st['l_b'] = (st['l_b'] * alpha_b + sum_b).astype(np.float32)
                        st['o'][:, :, 0] *= alpha_a; st['o'][:, :, 1] *= alpha_a
                        st['o'][:, :, 2] *= alpha_b; st['o'][:, :, 3] *= alpha_b
                        for kc in range(BC // 16):
                            a = afrag(s, kc, dtype)
                            for dp in range(D // 16):
                                addr = vst + (kc * 16 + (lm & 1) * 8 + lr) * LD + dp * 16 + (lm >> 1) * 8
                                vfr = sm.ldmatrix(w, addr, 4, 'vnotrans' not in MUT)
                                mma(st['o'][2 * dp], a, vfr[:, 0:2])
                                mma(st['o'][2 * dp + 1], a, vfr[:, 2:4])
                blk.finish()
                for w in range(NW):
                    st = W[w]
                    row_a = q0 + w * 16 + G; row_b = row_a + 8
                    la = quad_sum(st['l_a']); lb = quad_sum(st['l_b'])
                    for rows, L, m, e0 in ((row_a, la, st['m_a'], 0), (row_b, lb, st['m_b'], 2)):
                        for l in range(32):
                            if rows[l] < S:
                                inv = np.float32(1) / L[l]
                                for dt in range(D // 8):
                                    col = dt * 8 + 2 * T4[l]
                                    out[head * S * D + rows[l] * D + col: head * S * D + rows[l] * D + col + 2] = \
                                        rnd(st['o'][dt, l, e0:e0 + 2] * inv, dtype)
                                if T4[l] == 0:
                                    lse[head * S + rows[l]] = (m[l] + np.log2(L[l])) * np.float32(LN2)
    return out.reshape(B, Hq, S, D), lse.reshape(B, Hq, S)
