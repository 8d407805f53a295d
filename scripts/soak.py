"""Soak the commit protocol: thousands of SIGKILLs while a child saves checkpoints.

Runs :class:`checkpoint_store.testing.crash.CrashHarness` (the same harness as
``tests/crash``, for far more kills) on a local disk, on a moto S3 server it
starts on 127.0.0.1, or both, and prints one summary line per round::

    python scripts/soak.py --kills 2000                 # local disk
    python scripts/soak.py --backend s3 --kills 500     # moto S3 on 127.0.0.1
    python scripts/soak.py --backend all --rounds 5 --seed 7 --keep 3

Exits 1 at the first violation (the report names the kill and what broke),
leaving the storage directory in place for inspection (``--workdir``).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time


def _round(backend: str, args: argparse.Namespace, workdir: str, seed: int, s3) -> bool:
    from checkpoint_store.testing.crash import CrashConfig, CrashHarness

    here = tempfile.mkdtemp(prefix=f"soak-{backend}-", dir=workdir)
    if backend == "local":
        cfg = CrashConfig(storage_path=os.path.join(here, "store"),
                          log_path=os.path.join(here, "acks.log"),
                          num_to_keep=args.keep, files=args.files, file_size=args.file_size)
        delays = (0.02, 0.4)
    else:
        bucket = s3.create_bucket()
        cfg = CrashConfig(storage_path=f"s3://{bucket}/soak",
                          storage_options=s3.storage_options("pyarrow"), env=s3.env(),
                          log_path=os.path.join(here, "acks.log"), num_to_keep=args.keep,
                          files=args.files, file_size=args.file_size,
                          preload=("s3fs", "checkpoint_store_s3"))
        delays = (0.4, 1.6)
    harness = CrashHarness(cfg, seed=seed, min_delay=delays[0], max_delay=delays[1])
    report = harness.run(args.kills)
    print(f"[{backend} seed={seed}] {report.summary()}", flush=True)
    if report.violations:
        print(f"storage left for inspection in {here}", file=sys.stderr)
        return False
    return True


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", choices=["local", "s3", "all"], default="local")
    p.add_argument("--kills", type=int, default=1000, help="kills per round (default 1000)")
    p.add_argument("--rounds", type=int, default=1, help="rounds per backend, new seed each")
    p.add_argument("--seed", type=int, default=0, help="seed of the first round")
    p.add_argument("--keep", type=int, default=2, help="retention num_to_keep (default 2)")
    p.add_argument("--files", type=int, default=3, help="files per checkpoint")
    p.add_argument("--file-size", type=int, default=32 * 1024, help="bytes per file")
    p.add_argument("--workdir", default=None, help="where storage and logs go (default: tmp)")
    args = p.parse_args(argv)

    os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")
    workdir = args.workdir or tempfile.mkdtemp(prefix="cs-soak-")
    os.makedirs(workdir, exist_ok=True)
    backends = ["local", "s3"] if args.backend == "all" else [args.backend]
    s3 = None
    if "s3" in backends:
        from checkpoint_store.testing.servers import S3Server

        s3 = S3Server.start()
    t0 = time.monotonic()
    ok = True
    try:
        for backend in backends:
            for r in range(args.rounds):
                if not _round(backend, args, workdir, args.seed + r, s3):
                    ok = False
                    break
            if not ok:
                break
    finally:
        if s3 is not None:
            s3.stop()
    print(f"{'no violations' if ok else 'VIOLATION'} after {time.monotonic() - t0:.0f}s "
          f"(work directory {workdir})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
