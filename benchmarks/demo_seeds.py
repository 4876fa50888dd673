"""The embedded CPU default over several seeds: runs `stare-jax demo` once per seed (the RL sampling seed and the
data order change; the cached tokenizer and warm start are shared, as the demo specifies) and prints each seed's
checks plus how many seeds pass them all.

    python benchmarks/demo_seeds.py --seeds 0 1 2 --out runs/demo_seeds [--scenario tool]
"""
import argparse
import pathlib
import time

from stare_jax.demo import format_checks, run_demo
from stare_jax.plot import summary_table


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--out", default="runs/demo_seeds")
    ap.add_argument("--scenario", default="default", help="the demo's scenario: default or tool")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    passed = 0
    report = []
    for seed in args.seeds:
        t0 = time.time()
        res = run_demo(pathlib.Path(args.out) / f"seed{seed}", [f"seed={seed}", f"data.seed={seed}", *args.overrides],
                       scenario=args.scenario, log=lambda *_: None)
        ok = all(c[3] for c in res["checks"])
        passed += ok
        report.append(f"## seed {seed}: {'PASS' if ok else 'FAIL'} ({time.time() - t0:.0f} s, plot {res['plot']})\n\n"
                      + summary_table(res["run_dirs"]) + "\n" + format_checks(res["checks"]))
    text = "\n".join(report) + f"\n{passed} of {len(args.seeds)} seeds pass every check\n"
    (pathlib.Path(args.out) / "seeds.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
