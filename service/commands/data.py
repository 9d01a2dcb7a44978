"""attnserve data prepare translate"""


def add_arguments(p):
    p.add_argument("action", choices=["prepare"])
    p.add_argument("dataset", choices=["translate"])
    p.add_argument("--out", help="output folder (default $ATTNSERVE_HOME/data/translate)")


def run(args) -> int:
    from pathlib import Path

    from model.training.translate_data import prepare

    prepare(Path(args.out) if args.out else None)
    return 0
