"""The progress bar of `tierkv bench`: one line per benchmark phase."""

from __future__ import annotations

from rich.progress import BarColumn, Progress, TaskID, TextColumn, TimeElapsedColumn

from tierkv._cli_common import console


class Bar:
    """A rich progress bar with one line per benchmark phase, shown from the first phase on:
    started before the config was checked, it left a blank line above a config error. Called
    as ``bar(phase, done, total)``; ``with Bar() as bar:`` takes it down at the end."""

    def __init__(self) -> None:
        self._progress = Progress(
            TextColumn("{task.description:<28}"), BarColumn(),
            TextColumn("{task.completed}/{task.total}"), TimeElapsedColumn(), console=console,
            transient=True)
        self._tasks: dict[str, TaskID] = {}

    def __enter__(self) -> Bar:
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._tasks:
            self._progress.stop()

    def __call__(self, phase: str, done: int, total: int) -> None:
        if not self._tasks:
            self._progress.start()
        task = self._tasks.get(phase)
        if task is None:
            task = self._tasks[phase] = self._progress.add_task(phase, total=total)
        self._progress.update(task, completed=done, total=total)
