"""A helper process an env adapter talks to (OpenEnv's server, verifiers' server): its stderr kept in
a temporary file for the one-line errors, and stopped (terminate, then kill) when asked or at exit."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path


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


def venv_python(python, env_var: str, default_dir: str, missing: str) -> str:
    """The interpreter of an adapter's own venv: ``python``, else ``$env_var``'s venv, else the
    checkout's ``default_dir``; a one-line error (``missing``, with the path) when it is not there."""
    venv = os.environ.get(env_var) or str(Path(__file__).resolve().parents[2] / default_dir)
    py = python or os.path.join(venv, "bin", "python")
    if not os.access(py, os.X_OK):
        raise ValueError(missing.format(py=py))
    return py
