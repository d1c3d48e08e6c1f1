"""Peer copies: each process's local step kept by another process, moved through JAX's runtime.

:mod:`objckpt.peers.transfer` moves bytes between processes (JAX's transfer server, point to
point, beside the training step); :mod:`objckpt.peers.copies` sends each local step to its
keeper, writes what it receives into the keeper's local directory, and brings copies back
to their owners for a restore.
"""
