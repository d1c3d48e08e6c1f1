"""Opening an S3 store through obstore imports no fsspec client (s3fs, aiobotocore).

A restore in a fresh process (a job restarting) used to import both, ~0.25 s, only to
check option names obstore's translation reads anyway; an option outside those is still
checked against s3fs's signature, and refused by name when unknown.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import objckpt
from objckpt.errors import StorageOptionError
from objckpt.storage.obstore import config as obstore_config
from objckpt.storage.option_check import FSSPEC_OPTIONS, known_names

CLIENTS = ("s3fs", "aiobotocore", "botocore", "gcsfs")


def test_restore_through_obstore_imports_no_fsspec_client(s3_service):
    url = s3_service.url(f"imports-{os.getpid()}")
    options = s3_service.storage_options()
    tree = {"w": np.arange(4096, dtype=np.float32).reshape(64, 64), "step": 7}
    objckpt.save(url, tree, storage_options=options)
    probe = textwrap.dedent(
        f"""
        import json, sys
        import numpy as np
        import objckpt
        out = objckpt.restore({url!r}, storage_options=json.loads({json.dumps(json.dumps(options))}))
        assert out["step"] == 7 and np.array_equal(np.asarray(out["w"]), np.arange(4096, dtype=np.float32).reshape(64, 64))
        print(json.dumps(sorted(m for m in {CLIENTS!r} if m in sys.modules)))
        """
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "OBJCKPT_"))}
    env.update(s3_service.env(), JAX_PLATFORMS="cpu", PYTHONWARNINGS="ignore")
    done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.splitlines()[-1]) == []


def test_options_obstore_reads_are_the_fsspec_clients_own_names():
    # What the open leaves unchecked must be what the check would have let through.
    s3fs = pytest.importorskip("s3fs")
    session = pytest.importorskip("aiobotocore.session").AioSession
    assert obstore_config.FSSPEC_NAMED["s3"] <= known_names(s3fs.S3FileSystem, session) | FSSPEC_OPTIONS
    gcsfs = pytest.importorskip("gcsfs")
    gcs_known = known_names(gcsfs.GCSFileSystem) | FSSPEC_OPTIONS | {"request_timeout", "ca_bundle"}
    assert obstore_config.FSSPEC_NAMED["gcs"] <= gcs_known


def test_unknown_option_beside_known_ones_is_still_refused(s3_service):
    options = {**s3_service.storage_options(), "endpoint_ur": "http://x"}
    with pytest.raises(StorageOptionError, match=r"unknown storage option 'endpoint_ur'.*did you mean 'endpoint_url'"):
        objckpt.restore(s3_service.url("never-saved"), storage_options=options)
