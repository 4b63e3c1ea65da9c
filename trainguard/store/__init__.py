"""The run-directory format: schema, background writer, reader."""

from trainguard.store._codec import (
    MODE_FIELDS,
    MODES,
    PHASES,
    REACHED,
    REPLAYS_DIR,
    SCHEMA_VERSION,
    TAINTS,
    dumps,
    loads,
    to_plain_json,
)
from trainguard.store._findings import SEVERITIES, Finding, sort_findings
from trainguard.store._ops import ALIAS_OPS
from trainguard.store._ranked import RankedRun
from trainguard.store._ranks import default_name, is_collective, process_rank, rank_dir
from trainguard.store._reader import Run, short_op
from trainguard.store._runs import find_runs, open_run
from trainguard.store._shared import acquire_writer, release_writer
from trainguard.store._userfiles import is_user_file
from trainguard.store._writer import ExecBatch, RunWriter

__all__ = [
    "ALIAS_OPS",
    "MODES",
    "MODE_FIELDS",
    "PHASES",
    "REACHED",
    "REPLAYS_DIR",
    "SCHEMA_VERSION",
    "SEVERITIES",
    "TAINTS",
    "ExecBatch",
    "Finding",
    "RankedRun",
    "Run",
    "RunWriter",
    "acquire_writer",
    "default_name",
    "dumps",
    "find_runs",
    "is_collective",
    "is_user_file",
    "loads",
    "open_run",
    "process_rank",
    "rank_dir",
    "release_writer",
    "short_op",
    "sort_findings",
    "to_plain_json",
]
