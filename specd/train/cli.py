"""`specd train family OUT [--toy] [--device D]`: train the small model family."""

from __future__ import annotations

import argparse
from pathlib import Path


def _family(args: argparse.Namespace) -> int:
    from specd.train.family import Budget, train_family

    budget = Budget.toy() if args.toy else Budget()
    if args.time_scale != 1.0:  # shrink or stretch every stage's wall-clock budget
        for stage in (budget.target, budget.eagle3, budget.mtp, budget.draft):
            if stage.time_budget_s:
                stage.time_budget_s *= args.time_scale
    train_family(args.out, budget, device=args.device, seed=args.seed, corpus_root=args.corpus_root)
    return 0


def add_parser(sub) -> None:
    train = sub.add_parser("train", help="train specd's small model family (target and drafters)")
    stages = train.add_subparsers(dest="train_command", required=True)
    family = stages.add_parser("family", help="tokenizer, target, EAGLE-3, MTP and draft model")
    family.add_argument("out", type=Path)
    family.add_argument("--toy", action="store_true", help="CPU-test size: seconds, not minutes")
    family.add_argument("--device", default=None, help="cuda or cpu (default: cuda if present)")
    family.add_argument("--seed", type=int, default=0)
    family.add_argument("--corpus-root", type=Path, default=None,
                        help="a standard-library tree to train on (default: this Python's)")
    family.add_argument("--time-scale", type=float, default=1.0,
                        help="multiply every stage's time budget")
    family.set_defaults(func=_family)
