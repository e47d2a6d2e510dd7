# Runs the kernel mirrors against a float64 reference.
#   python run.py [fwd|all] [quick]
import sys, math, time
import numpy as np
from core import rnd, stats
import fwd

def ref(q, k, v, dout, scale):
    B, Hq, S, D = q.shape; group = Hq // k.shape[1]
    kk = np.repeat(k, group, 1).astype(np.float64); vv = np.repeat(v, group, 1).astype(np.float64)
    s = np.einsum('bhid,bhjd->bhij', q.astype(np.float64), kk) * scale
    mask = np.triu(np.ones((S, S), bool), 1); s[..., mask] = -np.inf
    mx = s.max(-1, keepdims=True)
    lse = np.log(np.exp(s - mx).sum(-1)) + mx[..., 0]
    p = np.exp(s - lse[..., None]); o = p @ vv
    dv = np.einsum('bhij,bhid->bhjd', p, dout); dp = dout @ vv.transpose(0, 1, 3, 2)
    delta = (dout * o).sum(-1); ds = p * (dp - delta[..., None])
    dq = ds @ kk * scale; dk = np.einsum('bhij,bhid->bhjd', ds, q) * scale
    sh = (B, Hq // group, group, S, D)
    return o, lse, dq, dk.reshape(sh).sum(2), dv.reshape(sh).sum(2)

def err(a, r):
    assert not np.isnan(a).any(), 'NaN in result (unwritten element?)'
    return np.abs(a - r).max() / max(1.0, np.abs(r).max())

def run(B, Hq, Hkv, S, D, dtype, seed=0, do_bwd=True, bwd=None):
    rng = np.random.default_rng(seed)
    q = rnd(rng.standard_normal((B, Hq, S, D)), dtype); k = rnd(rng.standard_normal((B, Hkv, S, D)), dtype)
    v = rnd(rng.standard_normal((B, Hkv, S, D)), dtype); dout = rnd(rng.standard_normal((B, Hq, S, D)), dtype)
    scale = 1 / math.sqrt(D)
    o_r, lse_r, dq_r, dk_r, dv_r = ref(q, k, v, dout, scale)
    t = time.time()
    o, lse = fwd.forward(q.ravel(), k.ravel(), v.ravel(), B, Hq, Hkv, S, D, scale, dtype)
    res = dict(out=err(o, o_r), lse=np.abs(lse - lse_r).max())
    if do_bwd and bwd is not None:
        # delta as delta_kernel computes it, from the rounded output
        delta = (o.astype(np.float64) * dout).sum(-1).astype(np.float32)
        dq, dk, dv = bwd(q, k, v, dout, lse, delta, B, Hq, Hkv, S, D, scale, dtype)
        res.update(dq=err(dq, dq_r), dk=err(dk, dk_r), dv=err(dv, dv_r))
    print(f'{dtype} B={B} Hq={Hq} Hkv={Hkv} S={S} D={D}: ' + ' '.join(f'{k} {v:.2e}' for k, v in res.items())
          + f'  ({time.time() - t:.1f}s)', flush=True)
    return res

SHAPES = [(1, 2, 1, 1, 64), (1, 2, 1, 17, 64), (1, 4, 2, 77, 64), (1, 2, 1, 130, 128), (1, 1, 1, 300, 64),
          (1, 1, 1, 300, 128), (2, 4, 1, 77, 128), (1, 4, 4, 130, 64), (1, 2, 2, 17, 128), (1, 1, 1, 1, 128),
          (1, 4, 1, 300, 64), (1, 2, 1, 300, 128), (1, 2, 1, 257, 64), (1, 1, 1, 256, 128)]

if __name__ == '__main__':
    what = sys.argv[1] if len(sys.argv) > 1 else 'all'
    bwd = None
    if what == 'all':
        import bwd as bwdmod
        bwd = bwdmod.backward
    worst = {}
    for dtype in ('bf16', 'f16'):
        for sh in SHAPES:
            r = run(*sh, dtype, bwd=bwd)
            for k, v in r.items():
                worst[(dtype, k)] = max(worst.get((dtype, k), 0), v)
    print('worst:', {f'{a}/{b}': f'{v:.2e}' for (a, b), v in worst.items()})
    print('stats:', stats)
