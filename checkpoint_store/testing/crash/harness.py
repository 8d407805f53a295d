"""The kill loop: start the child, SIGKILL it after a random delay, check, repeat."""

from __future__ import annotations

import os
import random
import signal
import time
from dataclasses import asdict, dataclass, field

from checkpoint_store.testing.crash._child import CrashConfig, Zygote
from checkpoint_store.testing.crash.check import check_trial

__all__ = ["CrashHarness", "CrashReport"]


@dataclass
class CrashReport:
    """What :meth:`CrashHarness.run` saw."""

    kills: int = 0
    saves_acknowledged: int = 0
    newest_step: int = -1
    violations: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def summary(self) -> str:
        head = (f"{self.kills} kills, {self.saves_acknowledged} saves acknowledged, newest step "
                f"{self.newest_step}, {len(self.violations)} violations in {self.seconds:.1f}s")
        return "\n".join([head, *self.violations[:20]])


class CrashHarness:
    """Runs the child, kills it, checks, repeats.

    Args:
        config: see :class:`CrashConfig`.
        seed: seeds the kill delays (the run is reproducible up to timing).
        min_delay, max_delay: each child is killed after a uniform random
            delay in this range (seconds) from its start; the range should
            cover the session start and a few saves.
    """

    def __init__(self, config: CrashConfig, *, seed: int = 0, min_delay: float = 0.02,
                 max_delay: float = 0.4):
        if not 0 <= min_delay <= max_delay:
            raise ValueError("need 0 <= min_delay <= max_delay")
        self.config = config
        self.rng = random.Random(seed)
        self.min_delay, self.max_delay = min_delay, max_delay

    def _acks(self) -> int:
        try:
            with open(self.config.log_path) as f:
                return sum(1 for _ in f)
        except FileNotFoundError:
            return 0

    def run(self, kills: int, *, stop_on_violation: bool = True) -> CrashReport:
        """Kill the child ``kills`` times, checking after each kill."""
        report = CrashReport()
        t0 = time.monotonic()
        cfg = asdict(self.config)
        from checkpoint_store.registry import resolve

        backend, root = resolve(self.config.storage_path,
                                storage_options=self.config.storage_options)
        zygote = Zygote(self.config.preload)
        try:
            for _ in range(kills):
                pid = zygote.ask(op="spawn", config=cfg)["pid"]
                time.sleep(self.rng.uniform(self.min_delay, self.max_delay))
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                code = zygote.ask(op="wait", pid=pid)["exitcode"]
                report.kills += 1
                if code != -signal.SIGKILL:
                    report.violations.append(
                        f"kill {report.kills}: the child exited by itself (code {code}) "
                        "before the kill; it must save until killed (its traceback is on stderr)"
                    )
                bad, newest = check_trial(self.config, backend, root)
                report.newest_step = newest
                report.violations.extend(f"kill {report.kills}: {v}" for v in bad)
                if report.violations and stop_on_violation:
                    break
        finally:
            zygote.close()
        report.saves_acknowledged = self._acks()
        report.seconds = time.monotonic() - t0
        return report
