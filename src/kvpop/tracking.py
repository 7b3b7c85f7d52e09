"""The one module that talks to MLflow.

Stages only write here; none reads it back (what a stage reads is a declared DVC input).
Every stage logs one run into a single tracking store at a fixed absolute location:
``<repo>/mlflow.db`` (SQLite), unless ``MLFLOW_TRACKING_URI`` says otherwise. Runs carry the DVC
experiment name (``DVC_EXP_NAME``, which ``dvc exp run`` sets for its stages; ``workspace`` for a
plain ``dvc repro``) as the tag ``dvc_exp`` and, where the run's params hold a ``budget``, the tag
``budget``; both are also in the run's name (:func:`run_title`, e.g. ``evaluate · budget 384 ·
lippy-taal``), the one column MLflow's runs table always shows, so two experiments' runs differ at a
glance. The tag ``stage`` keeps the stage's own word (``train``) for searches.
Launch the UI with ``mlflow ui --backend-store-uri sqlite:///$PWD/mlflow.db``.

``KVPOP_TRACKING=off`` runs the stages without MLflow (a machine without it, such as a GPU host
that runs the stage scripts by ``pipeline/run_stages.py``): nothing is logged, the stage says so once, and
every output file is written as usual. Any other value than ``on`` (the default) or ``off`` is refused.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

EXPERIMENT = "kvpop"


def repo_root() -> Path:
    """The repository root: the nearest parent holding dvc.yaml (else the working directory)."""
    here = Path.cwd().resolve()
    for p in (here, *here.parents):
        if (p / "dvc.yaml").is_file():
            return p
    return here


def tracking_uri() -> str:
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{repo_root() / 'mlflow.db'}"


def experiment_tag() -> str:
    return os.environ.get("DVC_EXP_NAME") or "workspace"


def run_title(name: str, params: Mapping[str, Any]) -> str:
    """A run's name in the MLflow UI: ``name``, the budget where ``params`` hold one, and the DVC
    experiment (``train/kvpop · budget 384 · lippy-taal``)."""
    budget = params.get("budget")
    return " · ".join([name, *([f"budget {budget}"] if budget is not None else []), experiment_tag()])


def run_tags(stage: str, params: Mapping[str, Any]) -> dict[str, str]:
    """The tags every run carries: ``stage``, ``dvc_exp`` and, where ``params`` hold one, ``budget``."""
    budget = params.get("budget")
    return {"stage": stage, "dvc_exp": experiment_tag(), **({"budget": str(budget)} if budget is not None else {})}


def _flatten(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = json.dumps(v) if isinstance(v, (list, tuple)) else v
    return out


def _quiet() -> None:
    for name in ("alembic", "mlflow", "mlflow.store", "sqlalchemy"):
        logging.getLogger(name).setLevel(logging.WARNING)


def tracking_enabled() -> bool:
    """Whether stages log to MLflow: ``KVPOP_TRACKING`` ``on`` (default) or ``off``; other values are a ValueError."""
    value = os.environ.get("KVPOP_TRACKING", "on").strip().lower()
    if value not in ("on", "off"):
        raise ValueError(f"KVPOP_TRACKING must be 'on' or 'off', got {value!r}")
    return value == "on"


@contextlib.contextmanager
def stage_run(stage: str, params: Mapping[str, Any], run_name: str | None = None) -> Iterator[StageRun]:
    """One MLflow run for one stage execution, named ``run_name`` (default ``stage``) with the budget
    and the DVC experiment (:func:`run_title`); params flattened with dotted keys. With tracking off
    (``KVPOP_TRACKING=off``) an :class:`UntrackedRun` that logs nothing."""
    if not tracking_enabled():
        logging.getLogger(__name__).warning("KVPOP_TRACKING=off: stage %s is not logged to MLflow", run_name or stage)
        yield UntrackedRun(stage)
        return
    import mlflow

    _quiet()
    mlflow.set_tracking_uri(tracking_uri())
    mlflow.set_experiment(EXPERIMENT)
    with mlflow.start_run(run_name=run_title(run_name or stage, params), tags=run_tags(stage, params)) as run:
        mlflow.log_params(_flatten(params))
        yield StageRun(run.info.run_id, stage)


class StageRun:
    """Handle of the active stage run."""

    def __init__(self, run_id: str, stage: str = ""):
        self.run_id = run_id
        self.stage = stage

    @contextlib.contextmanager
    def child(self, name: str, params: Mapping[str, Any], tags: Mapping[str, str] | None = None) -> Iterator[StageRun]:
        """A child run under this one (MLflow's nested runs: the UI folds them under the parent), e.g.
        one per evaluated policy, so that a metric of the same name can be charted across policies
        and experiments. Named and tagged like the parent (:func:`run_title`, :func:`run_tags`) plus ``tags``."""
        import mlflow

        all_tags = {**run_tags(self.stage, params), **(tags or {})}
        with mlflow.start_run(run_name=run_title(name, params), nested=True, parent_run_id=self.run_id, tags=all_tags) as run:
            mlflow.log_params(_flatten(params))
            yield StageRun(run.info.run_id, self.stage)

    def metrics(self, metrics: Mapping[str, Any], step: int | None = None, prefix: str = "") -> None:
        import mlflow

        flat = {k: float(v) for k, v in _flatten(metrics, prefix).items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        if flat:
            mlflow.log_metrics(flat, step=step)

    def tags(self, tags: Mapping[str, Any]) -> None:
        """Bookkeeping a reader looks up but never charts (devices, seconds, resumed_from_step)."""
        import mlflow

        mlflow.set_tags({k: str(v) for k, v in _flatten(tags).items()})

    def artifact(self, path: str | Path) -> None:
        import mlflow

        path = Path(path)
        if path.is_dir():
            mlflow.log_artifacts(str(path), artifact_path=path.name)
        elif path.is_file():
            mlflow.log_artifact(str(path))

    def lightning_logger(self):
        """A Lightning MLFlowLogger writing into this same run."""
        from lightning.pytorch.loggers import MLFlowLogger

        return MLFlowLogger(experiment_name=EXPERIMENT, tracking_uri=tracking_uri(), run_id=self.run_id, log_model=False)


class UntrackedRun:
    """A stage run with tracking off (``KVPOP_TRACKING=off``): the interface of :class:`StageRun`, logging nothing."""

    def __init__(self, stage: str = ""):
        self.run_id = None
        self.stage = stage

    @contextlib.contextmanager
    def child(self, name: str, params: Mapping[str, Any], tags: Mapping[str, str] | None = None) -> Iterator[UntrackedRun]:
        yield self

    def metrics(self, metrics: Mapping[str, Any], step: int | None = None, prefix: str = "") -> None:
        pass

    def tags(self, tags: Mapping[str, Any]) -> None:
        pass

    def artifact(self, path: str | Path) -> None:
        pass

    def lightning_logger(self):
        return False  # Lightning's "no logger"
