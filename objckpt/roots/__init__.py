"""Manager roots: a root's step names, its listing, deleting checkpoints under it, and gc's sweep.

A manager root holds one checkpoint per step, ``<root>/step_0000000042/``
(:mod:`objckpt.roots.step_names`), and maybe steps Orbax's ``CheckpointManager`` wrote
(:mod:`objckpt.roots.orbax_steps`). What lists a root (:mod:`objckpt.roots.listing`)
and what deletes under one (:mod:`objckpt.roots.sweep`) live here, once, for
``CheckpointManager`` (retention, replicas, gc), ``objckpt ls``/``rm``/``gc``/``cp``,
:func:`objckpt.tools.copy_root.copy_steps` and the conversion of Orbax roots. No JAX.
"""
