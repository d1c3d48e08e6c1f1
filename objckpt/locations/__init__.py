"""Where a step's copies are, and which one every process restores from.

A step may be restored from several locations: each process's local directory
(:mod:`objckpt.locations.local_dirs`), the copy a peer keeps of it (moved by
:mod:`objckpt.peers`), and the manager's object store. This package lists the
copies each process holds and checks they are this root's (:mod:`objckpt.locations.run_keys`),
has every process agree on one step and the order of the locations to try
(:mod:`objckpt.locations.agreement`), then reads each copy through the one restore,
failing over to the next location together (:mod:`objckpt.locations.tiers`).
Replicas of a whole checkpoint in other buckets are failed over inside one restore
(:mod:`objckpt.restoring.locations`).
"""
