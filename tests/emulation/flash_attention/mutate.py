# Mutation check: each mutation must be caught (SimError / assertion) or give a large error.
import sys, importlib
import numpy as np
import core, run
mods = sys.argv[1].split(',')
muts = sys.argv[2].split(',')
for mname in muts:
    for modname in mods:
        importlib.import_module(modname).MUT.clear()
    mod = importlib.import_module(mods[0]) if ':' not in mname else importlib.import_module(mname.split(':')[0])
    m = mname.split(':')[-1]
    mod.MUT.add(m)
    try:
        import bwd
        r = run.run(1, 2, 1, 130, 64, 'bf16', bwd=bwd.backward if 'bwd' in sys.argv[3:] else None)
        bad = max(r.values())
        print(f'MUTATION {mname}: ran, max error {bad:.2e} ->', 'CAUGHT (error)' if bad > 1e-2 else 'NOT CAUGHT')
    except (core.SimError, AssertionError, FloatingPointError) as e:
        print(f'MUTATION {mname}: CAUGHT by simulator: {type(e).__name__}: {e}')
    mod.MUT.discard(m)
