"""RELION's pipeliner protocol (`--pipeline_control DIR`): the job says how it ended by a file in its
job folder — RELION_JOB_EXIT_SUCCESS, RELION_JOB_EXIT_FAILURE or RELION_JOB_EXIT_ABORTED — and is
asked to stop by RELION_JOB_ABORT_NOW appearing there (the GUI's "Abort" button)."""

from __future__ import annotations

from pathlib import Path

SUCCESS = "RELION_JOB_EXIT_SUCCESS"
FAILURE = "RELION_JOB_EXIT_FAILURE"
ABORTED = "RELION_JOB_EXIT_ABORTED"
ABORT_NOW = "RELION_JOB_ABORT_NOW"


class PipelineControl:
    """The job folder of `--pipeline_control`."""

    def __init__(self, folder: Path | str) -> None:
        self.folder = Path(folder)

    def abort_requested(self) -> bool:
        return (self.folder / ABORT_NOW).exists()

    def finished(self, name: str) -> None:
        """Leave the exit file `name` (SUCCESS, FAILURE or ABORTED), removing the other two and ABORT_NOW."""
        self.folder.mkdir(parents=True, exist_ok=True)
        for other in (SUCCESS, FAILURE, ABORTED, ABORT_NOW):
            if other != name:
                (self.folder / other).unlink(missing_ok=True)
        (self.folder / name).touch()
