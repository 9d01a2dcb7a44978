"""attnserve train translate --config configs/translate.json [--resume] [--export-only] [--device cuda]"""

import sys

from service.commands import CommandError, check_at_least_one


def add_arguments(p):
    p.add_argument("task", choices=["translate"])
    p.add_argument("--config", default="configs/translate.json")
    p.add_argument("--run-dir", help="run folder (default $ATTNSERVE_HOME/runs/translate/<config name>)")
    p.add_argument("--resume", action="store_true", help="continue from the run folder's last state")
    p.add_argument("--export-only", action="store_true",
                   help="average the last snapshots and export them, no training")
    p.add_argument("--threads", type=int, help="torch threads (overrides the config; 1 while the cores are shared)")
    p.add_argument("--init-from", metavar="DIR",
                   help="start a new run from a shipped checkpoint's weights and vocabulary (e.g. "
                        "weights/attnserve-zh-en), continuing its step count and lr schedule")
    p.add_argument("--device", default="cpu",
                   help="cpu or cuda[:N] (a resource setting: a run may resume on another device)")
    p.add_argument("--export-to", help="export folder (default <run folder>/export; weights/attnserve-zh-en ships it)")
    p.add_argument("--avg-last", type=int, metavar="N",
                   help="export the average of the last N snapshots (default: the config's avg_last)")


def run(args) -> int:
    from model.training.train_translate import Interrupted, train

    check_at_least_one(threads=args.threads, avg_last=args.avg_last)
    try:
        train(args.config, args.run_dir, resume=args.resume, export_only=args.export_only,
              export_to=args.export_to, threads=args.threads,
              init_from=args.init_from, avg_last=args.avg_last, device=args.device)
    # their messages say what to do; an OSError names its path (a --config folder, a --run-dir under a file).
    # A path given wrong is a usage error (2); a disk that fills hours into a run is a failure (1)
    except (OSError, ValueError) as e:
        usage = (ValueError, FileExistsError, FileNotFoundError, IsADirectoryError, NotADirectoryError)
        raise CommandError(str(e), 2 if isinstance(e, usage) else 1) from e
    except Interrupted as e:  # the shell's status for the signal: a supervisor sees the run was cut short
        command = f"attnserve train translate --config {args.config} --run-dir {e.run}"
        to = f" --export-to {args.export_to}" if args.export_to else ""
        print(f"attnserve train: {e}; continue with `{command} --resume{to}`" + (
            f", or export it as it is with `{command} --export-only{to}`" if to else ""), file=sys.stderr)
        return 128 + e.signum
    return 0
