"""`dspark train --config FILE.yaml [--resume [CHECKPOINT] | --score] [--drafter-type T] [key=value ...]`."""

import argparse

from dspark.train.config import DRAFTER_TYPES


def add_train_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "train", help="train a drafter for a target (torchrun --nproc-per-node N for data parallel)",
        description="Train a DSpark / DFlash / EAGLE-3 / MTP drafter on regenerated conversations. "
                    "Settings come from --config, then key=value overrides (e.g. lr=3e-4 max_steps=200).",
    )
    parser.add_argument("--config", help="YAML file of TrainConfig fields")
    parser.add_argument("--resume", nargs="?", const="latest", default=None,
                        help="continue from the newest checkpoint in output_dir, or from the given checkpoint")
    parser.add_argument("--drafter-type", choices=DRAFTER_TYPES, default=None,
                        help="overrides drafter_type of the config")
    parser.add_argument("--score", action="store_true",
                        help="do not train: score the drafter init_from on every sample of the corpus data, "
                             "teacher-forced (the held-out metrics, overall and per source), e.g. two drafters on "
                             "one corpus of the target's answers to the same prompts: a paired comparison")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides")
    parser.set_defaults(handler=run_train)


def run_train(args: argparse.Namespace) -> None:
    import json
    import os
    from pathlib import Path

    from dspark.errors import DsparkError
    from dspark.train.config import load_config
    from dspark.train.trainer import score, train

    resume, overrides = args.resume, list(args.overrides)
    if resume not in (None, "latest") and "=" in resume and not Path(resume).exists():
        # `--resume output_dir=runs/x ...`: argparse gave the optional checkpoint the first override
        resume, overrides = "latest", [resume, *overrides]
    config = load_config(args.config, overrides, drafter_type=args.drafter_type)
    if args.score and resume:
        raise DsparkError("--score and --resume exclude each other (--score does not train)")
    result = score(config) if args.score else train(config, resume=resume)
    if int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps(result))
