"""Saves one tree to a URL and prints the outcome; used by the two-writer race test.

``python tests/save_child.py URL VALUE START_AT`` waits until the wall clock reaches
START_AT (so two writers start together), saves {"w": full(VALUE)}, prints
"committed" or "exists".
"""

from __future__ import annotations

import json
import os
import sys
import time

import jax.numpy as jnp

import objckpt


def main() -> None:
    url, value, start_at = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])
    storage_options = json.loads(os.environ.get("OBJCKPT_TEST_STORAGE_OPTIONS", "{}"))
    tree = {"w": jnp.full((512, 512), value, jnp.float32), "writer": value}
    time.sleep(max(0.0, start_at - time.time()))
    try:
        objckpt.save(url, tree, storage_options=storage_options)
        print("committed", flush=True)
    except objckpt.CheckpointExistsError:
        print("exists", flush=True)


if __name__ == "__main__":
    main()
