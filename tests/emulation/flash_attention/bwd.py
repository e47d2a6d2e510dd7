# Mirror of flash_backward_dkdv_kernel and flash_backward_dq_kernel (ldmatrix / ldmatrix.trans
# operands, double-buffered cp.async tiles, mask only on diagonal / ragged tiles).
import numpy as np
from core import *

MUT = set()


def dkdv(q, k, v, dout, lse, delta, B, Hq, Hkv, S, D, scale, dtype, dk, dv):
    NW = 4; NT = 32 * NW; BK = 16 * NW; BQ = 64 if D <= 64 else 32; LD = D + 8; STAGE = BQ * LD
    half_words = 2 * BK * LD + 4 * STAGE
    ksmem = 2 * half_words + 4 * 4 * BQ
    assert ksmem <= 163 * 1024 and (2 * half_words) % 16 == 0
    assert 2 * BQ <= NT
    KS, VS = 0, BK * LD; QS = VS + BK * LD; DOS = QS + 2 * STAGE
    group = Hq // Hkv
    sl2 = np.float32(scale * LOG2E)
    for b in range(B):
        for hk in range(Hkv):
            for bx in range(-(-S // BK)):
                k0 = bx * BK
                kvh = b * Hkv + hk
                first_tile = k0 // BQ
                q_tiles = -(-S // BQ) - first_tile
                steps = group * q_tiles
                sm = Smem(half_words, 2, NW, {'ks': (KS, VS), 'vs': (VS, QS), 'q0': (QS, QS + STAGE),
                                              'q1': (QS + STAGE, DOS), 'do0': (DOS, DOS + STAGE),
                                              'do1': (DOS + STAGE, half_words)})
                # floats: lse_s [2][BQ] then delta_s [2][BQ], right after the 16-bit words
                fs = Smem(4 * BQ, 4, NW, {'lse0': (0, BQ), 'lse1': (BQ, 2 * BQ), 'delta0': (2 * BQ, 3 * BQ),
                                          'delta1': (3 * BQ, 4 * BQ)}, base_byte=2 * half_words)
                blk = Block(NW, sm, fs)
                LSE, DELTA = 0, 2 * BQ

                def load_step(w, i):
                    head = b * Hq + hk * group + i // q_tiles
                    q0 = (first_tile + i % q_tiles) * BQ
                    stage = i & 1
                    if 'dkdv_stage' in MUT:
                        stage = 0
                    copy_rows_async(sm, w, QS + stage * STAGE, q, head * S * D, q0, S, BQ, D, LD, NT)
                    copy_rows_async(sm, w, DOS + stage * STAGE, dout, head * S * D, q0, S, BQ, D, LD, NT)
                    tids = np.arange(32 * w, 32 * w + 32)
                    tids = tids[tids < 2 * BQ]
                    for is_lse in (True, False):
                        t = tids[(tids < BQ) == is_lse]
                        if len(t) == 0:
                            continue
                        r = t % BQ
                        valid = q0 + r < S
                        src = lse if is_lse else delta
                        base = head * S
                        fs.cp_async(w, (LSE if is_lse else DELTA) + stage * BQ + r, src,
                                    np.where(valid, base + q0 + r, base), valid, 1, base, base + S)

                for w in range(NW):
                    copy_rows_async(sm, w, KS, k, kvh * S * D, k0, S, BK, D, LD, NT)
                    copy_rows_async(sm, w, VS, v, kvh * S * D, k0, S, BK, D, LD, NT)
                    load_step(w, 0)
                    sm.commit(w); fs.commit(w)
                lr = lanes & 7; lm = lanes >> 3
                acc = [(np.zeros((D // 8, 32, 4), np.float32), np.zeros((D // 8, 32, 4), np.float32)) for _ in range(NW)]
                for i in range(steps):
                    for w in range(NW):
                        sm.wait_all(w); fs.wait_all(w)
                    blk.sync()
                    for w in range(NW):
                        if i + 1 < steps:
                            load_step(w, i + 1)
                            sm.commit(w); fs.commit(w)
                        q0 = (first_tile + i % q_tiles) * BQ
                        warp_key0 = k0 + w * 16
                        key_a = warp_key0 + G; key_b = key_a + 8
                        if warp_key0 >= S or warp_key0 > q0 + BQ - 1:
                            continue
                        qst = QS + (i & 1) * STAGE; dost = DOS + (i & 1) * STAGE
                        lst = LSE + (i & 1) * BQ; dst = DELTA + (i & 1) * BQ
                        st = np.zeros((BQ // 8, 32, 4), np.float32); dpt = np.zeros((BQ // 8, 32, 4), np.float32)
                        for kc in range(D // 16):
                            ak = sm.ldmatrix(w, KS + (w * 16 + (lm & 1) * 8 + lr) * LD + kc * 16 + (lm >> 1) * 8, 4, False)
                            av = sm.ldmatrix(w, VS + (w * 16 + (lm & 1) * 8 + lr) * LD + kc * 16 + (lm >> 1) * 8, 4, False)
                            for np_ in range(BQ // 16):
                                qfr = sm.ldmatrix(w, qst + (np_ * 16 + (lm >> 1) * 8 + lr) * LD + kc * 16 + (lm & 1) * 8, 4, False)
                                dfr = sm.ldmatrix(w, dost + (np_ * 16 + (lm >> 1) * 8 + lr) * LD + kc * 16 + (lm & 1) * 8, 4, False)
                                mma(st[2 * np_], ak, qfr[:, 0:2]); mma(st[2 * np_ + 1], ak, qfr[:, 2:4])
                                mma(dpt[2 * np_], av, dfr[:, 0:2]); mma(dpt[2 * np_ + 1], av, dfr[:, 2:4])
                        need_mask = (warp_key0 + 15 > q0) or (q0 + BQ > S) or (warp_key0 + 16 > S)
                        if 'dkdv_nomask' in MUT:
                            need_mask = (q0 + BQ > S) or (warp_key0 + 16 > S)
                        for n in range(BQ // 8):
                            for e in range(4):
                                col = n * 8 + 2 * T4 + (e & 1)
                                lv = fs.read(w, lst + col); dv_ = fs.read(w, dst + col)
                                with np.errstate(over='ignore'):
                                    p = np.exp2(fmaf(st[n, :, e], sl2, -(lv * np.float32(LOG2E)).astype(np.float32))).astype(np.float32)
                                if need_mask:
                                    query = q0 + col; key = key_a if e < 2 else key_b
                                    p = np.where((key > query) | (query >= S) | (key >= S), np.float32(0), p)
                                st[n, :, e] = p
                                dpt[n, :, e] = p * (dpt[n, :, e] - dv_)
                        for kc in range(BQ // 16):
                            ap = afrag(st, kc, dtype); ads = afrag(dpt, kc, dtype)
                            for dp in range(D // 16):
                                off = (kc * 16 + (lm & 1) * 8 + lr) * LD + dp * 16 + (lm >> 1) * 8
                                if 'dkdv_trans' in MUT:
                                    off = (kc * 16 + (lm >> 1) * 8 + lr) * LD + dp * 16 + (lm & 1) * 8
                                dfr = sm.ldmatrix(w, dost + off, 4, True)
                                qfr = sm.ldmatrix(w, qst + off, 4, True)
                                mma(acc[w][1][2 * dp], ap, dfr[:, 0:2]); mma(acc[w][1][2 * dp + 1], ap, dfr[:, 2:4])
                                mma(acc[w][0][2 * dp], ads, qfr[:, 0:2]); mma(acc[w][0][2 * dp + 1], ads, qfr[:, 2:4])
                blk.finish()
                for w in range(NW):
                    for l in range(32):
                        for key, e0 in ((k0 + w * 16 + G[l], 0), (k0 + w * 16 + G[l] + 8, 2)):
                            if key < S:
                                for dt in range(D // 8):
                                    col = dt * 8 + 2 * T4[l]
                                    o = kvh * S * D + key * D + col
                                    dk[o:o + 2] = rnd(acc[w][0][dt, l, e0:e0 + 2] * np.float32(scale), dtype)
                                    dv[o:o + 2] = rnd(acc[w][1][dt, l, e0:e0 + 2], dtype)


def dqk(q, k, v, dout, lse, delta, B, Hq, Hkv, S, D, scale, dtype, dq):
    NW = 4; NT = 32 * NW; BQ = 16 * NW; BK = 64 if D <= 64 else 32; LD = D + 8; STAGE = BK * LD
    n = 2 * BQ * LD + 4 * STAGE
    assert 2 * n <= 163 * 1024
    QS, DOS = 0, BQ * LD; KS = 2 * BQ * LD; VS = KS + 2 * STAGE
    group = Hq // Hkv
    sl2 = np.float32(scale * LOG2E)
    gx = -(-S // BQ)
    for b in range(B):
        for h in range(Hq):
            for bx in range(gx):
                tile = gx - 1 - bx
                head = b * Hq + h; kvh = b * Hkv + h // group
                kb = kvh * S * D
                q0 = tile * BQ
                tiles = (min(q0 + BQ, S) - 1) // BK + 1
                sm = Smem(n, 2, NW, {'qs': (QS, DOS), 'dos': (DOS, KS), 'k0': (KS, KS + STAGE), 'k1': (KS + STAGE, VS),
                                     'v0': (VS, VS + STAGE), 'v1': (VS + STAGE, n)})
                blk = Block(NW, sm)
                for w in range(NW):
                    copy_rows_async(sm, w, QS, q, head * S * D, q0, S, BQ, D, LD, NT)
                    copy_rows_async(sm, w, DOS, dout, head * S * D, q0, S, BQ, D, LD, NT)
                    copy_rows_async(sm, w, KS, k, kb, 0, S, BK, D, LD, NT)
                    copy_rows_async(sm, w, VS, v, kb, 0, S, BK, D, LD, NT)
                    sm.commit(w)
                lr = lanes & 7; lm = lanes >> 3
                acc = [np.zeros((D // 8, 32, 4), np.float32) for _ in range(NW)]
                for kt in range(tiles):
                    for w in range(NW):
                        sm.wait_all(w)
                    blk.sync()
                    for w in range(NW):
                        if kt + 1 < tiles:
                            nxt = (kt + 1) & 1
                            if 'dq_stage' in MUT:
                                nxt = kt & 1
                            copy_rows_async(sm, w, KS + nxt * STAGE, k, kb, (kt + 1) * BK, S, BK, D, LD, NT)
                            copy_rows_async(sm, w, VS + nxt * STAGE, v, kb, (kt + 1) * BK, S, BK, D, LD, NT)
                            sm.commit(w)
                        k0 = kt * BK
                        warp_row0 = q0 + w * 16
                        row_a = warp_row0 + G; row_b = row_a + 8
                        lse_a = np.array([lse[head * S + r] * np.float32(LOG2E) if r < S else np.inf for r in row_a], np.float32)
                        lse_b = np.array([lse[head * S + r] * np.float32(LOG2E) if r < S else np.inf for r in row_b], np.float32)
                        delta_a = np.array([delta[head * S + r] if r < S else 0 for r in row_a], np.float32)
                        delta_b = np.array([delta[head * S + r] if r < S else 0 for r in row_b], np.float32)
                        if warp_row0 >= S or k0 > warp_row0 + 15:
                            continue
                        kst = KS + (kt & 1) * STAGE; vst = VS + (kt & 1) * STAGE
                        s = np.zeros((BK // 8, 32, 4), np.float32); dp = np.zeros((BK // 8, 32, 4), np.float32)
                        for kc in range(D // 16):
                            aq = sm.ldmatrix(w, QS + (w * 16 + (lm & 1) * 8 + lr) * LD + kc * 16 + (lm >> 1) * 8, 4, False)
                            ad = sm.ldmatrix(w, DOS + (w * 16 + (lm & 1) * 8 + lr) * LD + kc * 16 + (lm >> 1) * 8, 4, False)
                            for np_ in range(BK // 16):
                                kfr = sm.ldmatrix(w, kst + (np_ * 16 + (lm >> 1) * 8 + lr) * LD + kc * 16 + (lm & 1) * 8, 4, False)
                                vfr = sm.ldmatrix(w, vst + (np_ * 16 + (lm >> 1) * 8 + lr) * LD + kc * 16 + (lm & 1) * 8, 4, False)
                                mma(s[2 * np_], aq, kfr[:, 0:2]); mma(s[2 * np_ + 1], aq, kfr[:, 2:4])
                                mma(dp[2 * np_], ad, vfr[:, 0:2]); mma(dp[2 * np_ + 1], ad, vfr[:, 2:4])
                        need_mask = (k0 + BK - 1 > warp_row0) or (k0 + BK > S) or (warp_row0 + 16 > S)
                        if 'dq_nomask' in MUT:
                            need_mask = (k0 + BK > S) or (warp_row0 + 16 > S)
                        for nn in range(BK // 8):
                            for e in range(4):
                                with np.errstate(over='ignore'):
                                    p = np.exp2(fmaf(s[nn, :, e], sl2, -(lse_a if e < 2 else lse_b))).astype(np.float32)
                                if need_mask:
                                    key = k0 + nn * 8 + 2 * T4 + (e & 1); row = row_a if e < 2 else row_b
                                    p = np.where((key > row) | (key >= S) | (row >= S), np.float32(0), p)
                                s[nn, :, e] = p * (dp[nn, :, e] - (delta_a if e < 2 else delta_b))
                        for kc in range(BK // 16):
                            a = afrag(s, kc, dtype)
                            for dp2 in range(D // 16):
                                kfr = sm.ldmatrix(w, kst + (kc * 16 + (lm & 1) * 8 + lr) * LD + dp2 * 16 + (lm >> 1) * 8, 4, 'dq_notrans' not in MUT)
                                mma(acc[w][2 * dp2], a, kfr[:, 0:2]); mma(acc[w][2 * dp2 + 1], a, kfr[:, 2:4])
                blk.finish()
                for w in range(NW):
                    for l in range(32):
                        for row, e0 in ((q0 + w * 16 + G[l], 0), (q0 + w * 16 + G[l] + 8, 2)):
                            if row < S:
                                for dt in range(D // 8):
                                    col = dt * 8 + 2 * T4[l]
                                    o = head * S * D + row * D + col
                                    dq[o:o + 2] = rnd(acc[w][dt, l, e0:e0 + 2] * np.float32(scale), dtype)


def backward(q, k, v, dout, lse, delta, B, Hq, Hkv, S, D, scale, dtype):
    q, k, v, dout = (x.ravel().astype(np.float32) for x in (q, k, v, dout))
    lse = lse.ravel().astype(np.float32); delta = delta.ravel().astype(np.float32)
    dq = np.full(B * Hq * S * D, np.nan, np.float32)
    dk = np.full(B * Hkv * S * D, np.nan, np.float32); dv = dk.copy()
    dkdv(q, k, v, dout, lse, delta, B, Hq, Hkv, S, D, scale, dtype, dk, dv)
    dqk(q, k, v, dout, lse, delta, B, Hq, Hkv, S, D, scale, dtype, dq)
    return dq.reshape(B, Hq, S, D), dk.reshape(B, Hkv, S, D), dv.reshape(B, Hkv, S, D)
