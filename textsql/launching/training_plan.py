"""What the master reads of the ranks' training arguments, and the batch that keeps a run's on fewer ranks.

The supervisor and the launch parse the launch's training arguments with the ranks' own parser
(:func:`textsql.planning.train_args.parse_command_line`, which knows every spelling of every flag) for where the
checkpoints are, whether the training resumes and reports to MLflow (:mod:`textsql.launching.tracking_env`), the
model (for the cluster check), the ranks' process-group timeout and the batch; when a run goes on with fewer workers,
:meth:`TrainingPlan.batch_for` says the training arguments that keep its global batch and order of examples.

Usage::

    >>> TrainingPlan(Path("out"), per_device_train_batch_size=4).batch_for(first_world=3, world=2)
    {'per_device_train_batch_size': 3, 'gradient_accumulation_steps': 2, 'length_group_size': 4}
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from textsql.arguments import RUN_DIR_FLAG
from textsql.errors import LaunchError
from textsql.launching.command import TRAIN_MODULE, LaunchArguments

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainingPlan:
    """What the supervisor reads of the ranks' training arguments, parsed by the ranks' own parser
    (:func:`textsql.planning.train_args.parse_command_line`); None fields for another module."""

    output_dir: Path | None = None
    per_device_train_batch_size: int = 1
    gradient_accumulation_steps: int = 1
    max_tokens_per_batch: int | None = None
    length_group_size: int | None = None
    model: str | None = None
    ddp_timeout: int | None = None
    save_total_limit: int | None = None
    resume_from_checkpoint: str | None = None
    overwrite_output_dir: bool = False
    report_to: str | list[str] | None = None
    rank_args: tuple[str, ...] = ()

    @classmethod
    def read(cls, arguments: LaunchArguments) -> TrainingPlan:
        """The plan of a launch of the training module, checked as every rank will check it before any rank starts
        (an empty one for any other module, whose arguments pass as they are).

        :rtype: TrainingPlan
        :raises TextSQLError: for arguments a rank would refuse, naming the fix; a LaunchError when they name
            another run directory than the launch's.
        """
        if arguments.module != TRAIN_MODULE:
            return cls(rank_args=tuple(arguments.train_args))
        from textsql.planning.train_args import check_train_args

        # The launch's run directory first: a --run-dir among the training arguments comes later and would win.
        rank_args = (RUN_DIR_FLAG, str(arguments.run_dir), *arguments.train_args)
        model_args, data_args, run_args, training = check_train_args(list(rank_args))
        if Path(training["output_dir"]).resolve() != arguments.run_dir.resolve():
            raise LaunchError(
                f"{RUN_DIR_FLAG} {training['output_dir']!r} after -- differs from the launch's {RUN_DIR_FLAG} "
                f"{str(arguments.run_dir)!r}; give the run directory once, before --"
            )
        return cls(
            Path(training["output_dir"]),
            training["per_device_train_batch_size"],
            training["gradient_accumulation_steps"],
            data_args.max_tokens_per_batch,
            data_args.length_group_size,
            model_args.model,
            training["ddp_timeout"],
            training.get("save_total_limit"),
            training.get("resume_from_checkpoint"),
            run_args.overwrite_output_dir,
            training["report_to"],
            rank_args,
        )

    def with_overrides(self, overrides: dict[str, Any]) -> TrainingPlan:
        """This plan as a relaunch with the supervisor's ``overrides`` (training arguments after the user's) sees it.

        :param overrides: training arguments by field name, each a field of the plan's.
        :rtype: TrainingPlan
        """
        known = {field.name for field in fields(self)}
        return replace(self, **{name: value for name, value in overrides.items() if name in known})

    def batch_for(self, first_world: int, world: int) -> dict[str, Any]:
        """Training arguments that keep the first launch's global batch and data order on ``world`` ranks.

        Examples per step: the per-rank batch shrinks to the largest divisor of the new per-rank share
        not above the old batch (no rank holds more at once than before), gradient accumulation makes up
        the rest, and the length groups keep their first size. With a token budget, accumulation grows to
        cover the lost ranks and the budget is cut so a step holds at most the tokens it held.

        :param first_world: ranks of the first launch.
        :param world: ranks now.
        :rtype: dict[str, typing.Any]
        :raises LaunchError: when the global batch does not divide among ``world`` ranks.
        """
        if world == first_world:
            return {}
        if self.max_tokens_per_batch:
            steps = math.ceil(self.gradient_accumulation_steps * first_world / world)
            budget = self.max_tokens_per_batch * self.gradient_accumulation_steps * first_world // (world * steps)
            return {"max_tokens_per_batch": budget, "gradient_accumulation_steps": steps}
        per_rank, rest = divmod(
            self.per_device_train_batch_size * self.gradient_accumulation_steps * first_world, world
        )
        if rest:
            raise LaunchError(
                f"the global batch of {per_rank * world + rest} questions does not divide among {world} ranks; "
                "pick a per-rank batch x workers that the smaller world divides, or min_workers = workers"
            )
        batch = max(size for size in range(1, self.per_device_train_batch_size + 1) if per_rank % size == 0)
        return {
            "per_device_train_batch_size": batch,
            "gradient_accumulation_steps": per_rank // batch,
            "length_group_size": self.length_group_size
            or self.per_device_train_batch_size * self.gradient_accumulation_steps,
        }
