"""A helper process an env adapter talks to (OpenEnv's server, verifiers' server): its stderr kept in
a temporary file for the one-line errors, and stopped (terminate, then kill) when asked or at exit."""
from __future__ import annotations

import subprocess


class ServerProcess:
    """Subclasses start ``self.proc`` with ``stderr=self.err`` (a ``tempfile.TemporaryFile``)."""

    proc: subprocess.Popen
    err: object

    @property
    def dead(self) -> bool:
        return self.proc.poll() is not None

    def tail(self) -> str:
        """The last non-empty line the process wrote to stderr (or ``empty``)."""
        self.err.seek(0)
        lines = [x.strip() for x in self.err.read().decode(errors="replace").splitlines() if x.strip()]
        return lines[-1] if lines else "empty"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
