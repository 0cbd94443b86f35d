"""The distributed run: the train loop's roles (engines, rollout workers, trainer) as Ray actors.

Nothing here is imported by an in-process run: `relax-gym train` without `cluster.mode: ray` never imports Ray.
"""
