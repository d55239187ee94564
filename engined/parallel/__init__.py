"""Pipeline and tensor parallelism: one engine over several ranks, rank 0 driving and the others mirroring it.

Plugs in where the engine is built (``model_split.prepare`` keeps this rank's part of the model,
``pipeline.MirroredRunner`` stands in for the runner) and where the step runs a pipeline's lanes;
``rank_link`` carries rank 0's journal and tokens to the other ranks, which rest on a ``doorbell``
while nothing is in flight.
"""
