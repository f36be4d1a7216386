"""Does the swarm keep learning when every rollout is S versions old? Held-out accuracy of the
trained policy per version at staleness S, for each objective, at equal trained samples, in one run.

S = 0 is a sequential (on-policy) run. S >= 1 is an async run whose trainer leases every rollout
for the version S before its own (`[run] lag = S`, bound `staleness = S + 1`; docs/protocols.md,
"Staleness on demand"), so each sample is S or S + 1 versions old (fewer in the first S versions,
which only version 0 precedes). Everything else is bench/learning.py's swarm: a trainer and 2
nodes sharing the CPUs, the task's model, sizes and lr, each version's adapter evaluated afterwards
on the run's held-out problems, greedy. Objectives are `trainer/grpo.py`'s: "tis" (today's default),
"icepop", "m2po".

    .venv/bin/python bench/staleness.py [--task demo|hard] [--staleness 0 1 2 4 8] [--objectives tis m2po]
        [--seeds 1] [--more-seeds 2] [--steps N] [--eval-every K] [--eval-prompts N] [--plot FILE] [--keep DIR] [--quick]

`--more-seeds` run S = 0 and the largest S again with those seeds, for the spread. Prints, per
objective and S, the held-out accuracy per evaluated version (mean over seeds), the mean age of
the trained samples and, averaged over steps, the mismatch KL, the share of tokens whose weight
was cut and the log ratio's second moment (every step's in the JSON). Ends with a JSON line:
`heldout_ratio_s4`, `heldout_ratio_s8` (the best objective's final held-out accuracy at S = 4 and
8 over S = 0's, means over seeds), `objective` (that best one, by its S = 8 or largest S),
`seed_spread` (the widest max - min over seeds of a final accuracy), and every run's figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import learning  # (bench/ is on the path when this runs as a script)
from echo_coordinator.config import OBJECTIVES  # (learning puts the repository on the path)


def run(args, objective: str, lag: int, seed: int, work: Path) -> dict:
    """One run: held-out accuracy per evaluated version and the steps' correction figures."""
    name = f"{objective}-s{lag}-seed{seed}"
    trainer = f'objective = "{objective}"'
    if lag == 0:
        records = learning.swarm_run(args, seed, work, name, trainer=trainer)
    else:
        records = learning.swarm_run(args, seed, work, name, mode="async", staleness=lag + 1,
                                     extra=f"lag = {lag}", trainer=trainer)
    ages = [(int(age), n) for r in records for age, n in r["staleness_histogram"].items()]
    return dict(accuracy=learning.adapters_accuracy(args, seed, work / name),
                age_mean=sum(a * n for a, n in ages) / max(sum(n for _, n in ages), 1),
                age_max=max((a for a, _ in ages), default=0),
                mismatch_kl=[r["mismatch_kl"] for r in records], cut=[r["tis_clipped_fraction"] for r in records],
                log_ratio_m2=[r["log_ratio_m2"] for r in records])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    learning.run_arguments(parser, "demo")
    parser.add_argument("--staleness", type=int, nargs="+", default=[0, 1, 2, 4, 8])
    parser.add_argument("--objectives", nargs="+", default=["tis", "m2po"], choices=OBJECTIVES)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1])
    parser.add_argument("--more-seeds", type=int, nargs="*", default=[2])
    parser.add_argument("--quick", action="store_true",
                        help="a smoke run: S 0 and 2, tis, 4 versions of 2 x 4 samples of 8 tokens")
    args = parser.parse_args()
    args.task_name, args.task_params, steps, args.lr = learning.TASKS[args.task]
    args.steps = args.steps or steps
    if args.quick:
        args.staleness, args.objectives, args.seeds, args.more_seeds = [0, 2], ["tis"], [1], []
        args.steps, args.prompts, args.group, args.eval_every, args.eval_prompts, args.tokens = 4, 2, 4, 4, 4, 8
    learning.resolve(args)
    largest = max(args.staleness)
    runs: dict[tuple[str, int], list[dict]] = {}
    with tempfile.TemporaryDirectory(prefix="echo-staleness-") as tmp:
        work = Path(args.keep or tmp)
        work.mkdir(parents=True, exist_ok=True)
        for objective in args.objectives:
            for lag in args.staleness:
                if lag == 0 and objective != args.objectives[0]:
                    runs[objective, 0] = runs[args.objectives[0], 0]  # on-policy: the objectives agree (w = 1)
                    continue
                seeds = args.seeds + (args.more_seeds if lag in (0, largest) else [])
                runs[objective, lag] = [run(args, objective, lag, seed, work) for seed in seeds]
    versions = learning.evaluated(args)
    final = {key: statistics.mean(r["accuracy"][versions[-1]] for r in rs) for key, rs in runs.items()}
    print(f"\nheld-out accuracy ({args.task}: {args.task_name} {args.task_params}, greedy, {args.eval_prompts} prompts), "
          "mean over seeds; per step means of the correction's figures")
    print(f"{'objective':>10}{'S':>4}{'seeds':>6}{'age':>6}" + "".join(f"{'v' + str(v):>8}" for v in versions)
          + f"{'KL':>9}{'cut':>8}{'M2':>9}")
    for (objective, lag), rs in runs.items():
        cells = "".join(f"{statistics.mean(r['accuracy'][v] for r in rs):>8.3f}" for v in versions)
        flat = {k: statistics.mean(x for r in rs for x in r[k]) for k in ("mismatch_kl", "cut", "log_ratio_m2")}
        print(f"{objective:>10}{lag:>4}{len(rs):>6}{statistics.mean(r['age_mean'] for r in rs):>6.2f}{cells}"
              f"{flat['mismatch_kl']:>9.4f}{flat['cut']:>8.3f}{flat['log_ratio_m2']:>9.4f}")
    best = max(args.objectives, key=lambda o: final[o, largest])

    def ratio(lag: int) -> float | None:
        return round(final[best, lag] / final[best, 0], 3) if (best, lag) in final and final[best, 0] > 0 else None

    spread = max(max(r["accuracy"][versions[-1]] for r in rs) - min(r["accuracy"][versions[-1]] for r in rs)
                 for rs in runs.values())
    print(f"best objective at S = {largest}: {best}; final held-out over S = 0's: S 4 {ratio(4)}, S 8 {ratio(8)}; "
          f"seed spread {spread:.3f}")
    if args.plot:
        from echo_coordinator.plot import plot_seeds

        samples = [v * args.prompts * args.group for v in versions]
        png = plot_seeds({f"{o} S={lag}": [dict(samples=samples, accuracy=[r["accuracy"][v] for v in versions])
                                           for r in rs] for (o, lag), rs in runs.items()},
                         Path(args.plot), f"{args.task_name} {args.task_params}: held-out accuracy at staleness S")
        print(f"curves: {png}")
    print(json.dumps(dict(heldout_ratio_s4=ratio(4), heldout_ratio_s8=ratio(8), objective=best,
                          seed_spread=round(spread, 3), task=f"{args.task_name} {args.task_params}",
                          versions=versions, samples_per_version=args.prompts * args.group, eval_prompts=args.eval_prompts,
                          runs={f"{o} S={lag}": [dict(seed_accuracy=[r["accuracy"][v] for v in versions],
                                                      age_mean=round(r["age_mean"], 2), age_max=r["age_max"],
                                                      mismatch_kl=[round(x, 5) for x in r["mismatch_kl"]],
                                                      cut=[round(x, 4) for x in r["cut"]],
                                                      log_ratio_m2=[round(x, 5) for x in r["log_ratio_m2"]])
                                                 for r in rs] for (o, lag), rs in runs.items()})))


if __name__ == "__main__":
    main()
