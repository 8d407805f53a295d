"""The saving child of the crash harness and the "zygote" that forks it.

The child resumes the trial and saves forever, appending one JSON line per
acknowledged save to a log; the parent (:class:`~checkpoint_store.testing.crash.CrashHarness`)
kills it with SIGKILL. Children are forked from the zygote, a process that
has already imported checkpoint-store, so a child starts in milliseconds.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import warnings
from dataclasses import dataclass, field
from typing import Any

__all__ = ["CrashConfig", "Zygote", "child_main", "file_name", "payload", "zygote_main"]


@dataclass(frozen=True)
class CrashConfig:
    """Where and how the child saves.

    Args:
        storage_path: local path or URI of the storage.
        log_path: a local file where the child appends one JSON line per
            acknowledged save (``report()`` returned).
        storage_options: backend options (credentials, endpoint) for a URI.
        experiment_name, trial_name: the trial the child writes.
        num_to_keep: retention's ``num_to_keep`` (>= 1).
        files: files per checkpoint; file sizes are ``file_size`` bytes.
        file_size: bytes per file.
        env: environment variables to set in the child (credentials, endpoints).
        preload: modules the forking helper imports once, so that children
            do not pay for them (e.g. ``("s3fs", "checkpoint_store_s3")``).
        source: ``"checkpoint"`` (a directory of files per save) or
            ``"state"`` (``report(state=...)``: file ``i`` becomes the uint8
            tensor ``files/<i>``, saved from memory through the staging area
            and the persist process).
        upload_mode: with ``"state"``, ``"async"`` (the child acknowledges
            a save once ``wait()`` returned) or ``"sync"``.
        staging_budget: with ``"state"``, the staging budget in bytes
            (None: the default); below ``files * file_size`` the state is
            staged in pieces while the persist process drains.
    """

    storage_path: str
    log_path: str
    storage_options: dict[str, Any] | None = None
    experiment_name: str = "crash"
    trial_name: str = "trial"
    num_to_keep: int = 2
    files: int = 3
    file_size: int = 32 * 1024
    env: dict[str, str] = field(default_factory=dict)
    preload: tuple[str, ...] = ()
    source: str = "checkpoint"
    upload_mode: str = "async"
    staging_budget: int | None = None


def payload(step: int, i: int, size: int) -> bytes:
    """The bytes of file ``i`` of the checkpoint saved at ``step`` (deterministic)."""
    seed = hashlib.blake2b(f"{step}/{i}".encode(), digest_size=32).digest()
    return (seed * (size // len(seed) + 1))[:size]


def file_name(i: int) -> str:
    return f"shard_{i}/data.bin" if i % 2 else f"data_{i}.bin"


def child_main(cfg_dict: dict[str, Any]) -> None:
    """The child: resume, then save forever. Killed by the parent."""
    os.environ.update(cfg_dict.get("env") or {})
    from checkpoint_store import Checkpoint, CheckpointConfig, UploadConfig, session

    cfg = CrashConfig(**cfg_dict)
    # Next to the log, so whoever owns the log's directory cleans up after kills.
    scratch = tempfile.mkdtemp(prefix="cs-crash-child-",
                               dir=os.path.dirname(os.path.abspath(cfg.log_path)))
    warnings.simplefilter("ignore")
    with session.start(
        storage_path=cfg.storage_path, storage_options=cfg.storage_options,
        experiment_name=cfg.experiment_name, trial_name=cfg.trial_name,
        checkpoint_config=CheckpointConfig(num_to_keep=cfg.num_to_keep),
        upload_config=UploadConfig(staging_budget=cfg.staging_budget),
    ) as s:
        latest = s.get_checkpoint()
        step = int(latest.internal_metadata["metrics"]["step"]) + 1 if latest else 0
        while True:
            if cfg.source == "state":
                import numpy as np

                state = {"files": {str(i): np.frombuffer(payload(step, i, cfg.file_size),
                                                         dtype=np.uint8)
                                   for i in range(cfg.files)}, "step": step}
                row = s.report({"step": step}, state=state, upload_mode=cfg.upload_mode)
                s.wait()
                ack = {"step": step, "dir": row["checkpoint_dir_name"],
                       "kept": s.manager.kept_dir_names}
                with open(cfg.log_path, "a") as log:
                    log.write(json.dumps(ack) + "\n")
                step += 1
                continue
            for i in range(cfg.files):
                path = os.path.join(scratch, file_name(i))
                os.makedirs(os.path.dirname(path), exist_ok=True)
                with open(path, "wb") as f:
                    f.write(payload(step, i, cfg.file_size))
            row = s.report({"step": step}, checkpoint=Checkpoint.from_directory(scratch))
            ack = {"step": step, "dir": row["checkpoint_dir_name"],
                   "kept": s.manager.kept_dir_names}
            with open(cfg.log_path, "a") as log:
                log.write(json.dumps(ack) + "\n")
            step += 1



class Zygote:
    """A process that has imported checkpoint-store and forks children on request.

    ``python -m checkpoint_store.testing.crash zygote`` reads JSON commands on
    stdin (``spawn`` with a config, optionally ``main`` and ``setsid`` (a new
    session and process group, as ``start_new_session=True``) -> child pid;
    ``wait`` with a pid -> exit code; ``poll`` -> exit code or None) and
    answers one JSON line each. A child's exit code is the one its
    ``SystemExit`` asked for (130 for an uncaught ``KeyboardInterrupt``).
    Forking from it makes a child start in milliseconds; the parent kills
    children by pid with SIGKILL.
    """

    def __init__(self, preload: tuple[str, ...] = ()) -> None:
        import subprocess
        import sys

        self._proc = subprocess.Popen(
            [sys.executable, "-m", "checkpoint_store.testing.crash", "zygote", *preload],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1,
        )

    def ask(self, **cmd: Any) -> dict[str, Any]:
        assert self._proc.stdin is not None and self._proc.stdout is not None
        self._proc.stdin.write(json.dumps(cmd) + "\n")
        self._proc.stdin.flush()
        line = self._proc.stdout.readline()
        if not line:
            raise RuntimeError("the crash-harness zygote process died")
        return json.loads(line)

    def close(self) -> None:
        if self._proc.poll() is None:
            assert self._proc.stdin is not None
            self._proc.stdin.close()
            try:
                self._proc.wait(10)
            except Exception:  # noqa: BLE001
                self._proc.kill()
                self._proc.wait()


def zygote_main(preload: list[str]) -> None:
    import importlib
    import signal
    import sys

    import checkpoint_store.session  # noqa: F401  (imported once, before forking)

    for name in preload:
        importlib.import_module(name)

    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "spawn":
            pid = os.fork()
            if pid == 0:
                code = 1
                try:
                    # As a program started from a shell: Ctrl-C raises
                    # KeyboardInterrupt even where the suite itself runs with
                    # SIGINT ignored (a shell's background job inherits
                    # SIG_IGN, and Python then installs no handler).
                    signal.signal(signal.SIGINT, signal.default_int_handler)
                    if cmd.get("setsid"):  # as Popen(start_new_session=True): its own group
                        os.setsid()
                    devnull = os.open(os.devnull, os.O_RDWR)
                    os.dup2(devnull, 0)
                    os.dup2(devnull, 1)  # never write into the command channel
                    main = cmd.get("main")  # "module:function", else the saving child
                    if main:
                        mod, _, fn = main.partition(":")
                        getattr(importlib.import_module(mod), fn)(cmd["config"])
                    else:
                        child_main(cmd["config"])
                    code = 0
                except SystemExit as exc:  # the status the child's own exit asked for
                    code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
                except KeyboardInterrupt:
                    code = 128 + 2  # what a shell reports for a Ctrl-C'd program
                except BaseException:  # noqa: BLE001
                    import traceback

                    traceback.print_exc()
                finally:
                    os._exit(code)
            answer: dict[str, Any] = {"pid": pid}
        elif cmd["op"] == "wait":
            _, status = os.waitpid(cmd["pid"], 0)
            answer = {"exitcode": os.waitstatus_to_exitcode(status)}
        elif cmd["op"] == "poll":  # None while the child runs
            done, status = os.waitpid(cmd["pid"], os.WNOHANG)
            answer = {"exitcode": os.waitstatus_to_exitcode(status) if done else None}
        else:
            answer = {"error": f"unknown op {cmd['op']!r}"}
        sys.stdout.write(json.dumps(answer) + "\n")
        sys.stdout.flush()
