"""Tensor and pipeline parallelism: ranks started by torchrun, rank 0 drives, the others follow.

* ``launch``   -- the command-line side: validate, re-run the command under torchrun, divert
                  ranks other than 0 into the worker loop.
* ``topology`` -- process groups and this rank's place (TP rank, pipeline stage).
* ``wire``     -- one step's batch as one flat int64 tensor (the per-step broadcast).
* ``stage``    -- what every rank runs for a step: its stage of every micro-batch.
* ``driver``   -- rank 0's model runner: splits, broadcasts, runs its stage, collects logits.
* ``pipeline`` -- pipeline parallelism across steps: batches in flight, booked oldest first.
* ``worker``   -- the loop of every other rank.
* ``watchdog`` -- no hangs, no orphans: fatal exits and parent watching.
"""
