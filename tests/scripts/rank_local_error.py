"""A check that fails on rank 1 only: inside main_process_first (`main-first`), or anywhere (`alone`, rank 0
then waits at a barrier that breaks when rank 1 leaves). Every rank must stop, the sentence said once."""

import sys

import toolkit
from toolkit.errors import UserError

accelerator = toolkit.build_accelerator()
if sys.argv[1] == "main-first":
    with accelerator.main_process_first():
        if accelerator.process_index == 1:
            raise UserError("rank 1 cannot read its shard file.")
elif accelerator.process_index == 1:
    raise UserError("rank 1 cannot read its shard file.")
accelerator.wait_for_everyone()
print("not reached: every rank should have stopped")
