"""The Weights & Biases sink of the metrics logger (``logging.wandb``; wandb is optional).

The W&B run lives in ``<run_dir>/wandb/`` and its id in ``<run_dir>/wandb_run_id``: a fresh run
makes a new id, ``--resume`` reads it back and continues the same W&B run (``resume="allow"``).
W&B keeps one value per step and accepts steps in increasing order only, so the steps that a
crashed run logged after its last checkpoint keep their first values there (it warns and drops the
recomputed ones); metrics.jsonl and TensorBoard hold the recomputed values.  Offline mode writes
``<run_dir>/wandb/offline-run-*/`` without network or account (``wandb sync`` uploads it later).
"""
from __future__ import annotations

import secrets
from pathlib import Path
from typing import Mapping, Optional

from ..config import WandbConfig

RUN_ID_FILE = "wandb_run_id"


class WandbRun:
    def __init__(self, cfg: WandbConfig, run_dir, resume: bool, run_config: Optional[Mapping] = None):
        import wandb

        run_dir = Path(run_dir)
        id_file = run_dir / RUN_ID_FILE
        run_id = id_file.read_text().strip() if resume and id_file.exists() else secrets.token_hex(6)
        id_file.write_text(run_id)
        try:
            # console="off": wandb leaves stdout/stderr (the progress bar) alone
            self.run = wandb.init(project=cfg.project, entity=cfg.entity, name=cfg.name or run_dir.resolve().name,
                                  tags=list(cfg.tags), mode=cfg.mode, dir=str(run_dir), id=run_id, resume="allow",
                                  config=dict(run_config) if run_config is not None else None,
                                  settings=wandb.Settings(console="off"))
        except Exception as e:  # no network / not logged in (online mode): one line naming the key
            msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
            raise RuntimeError(f"logging.wandb: wandb.init failed ({type(e).__name__}: {msg}); "
                               f"logging.wandb.mode=offline needs no network") from None
        self.run_id = run_id

    def log(self, step: int, flat: Mapping) -> None:
        """One step's flattened record (None values left out, as in TensorBoard)."""
        self.run.log({k: v for k, v in flat.items() if v is not None}, step=int(step))

    def log_table(self, step: int, key: str, rows: list) -> None:
        """``rows`` (dicts with the same keys) as one W&B table at ``step``."""
        import wandb

        columns = list(rows[0])
        self.run.log({key: wandb.Table(columns=columns, data=[[r.get(c) for c in columns] for r in rows])},
                     step=int(step))

    def close(self) -> None:
        """Finish the run and wait until its data is written: ``finish`` alone may return before
        wandb's service flushed the run file, and its exit hook does not run reliably in
        multiprocessing children such as the trainer ranks."""
        import wandb

        if self.run is not None:
            self.run.finish()
            self.run = None
            wandb.teardown()
