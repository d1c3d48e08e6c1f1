"""A refused request (HTTP 403) says the service's error code and message, not its raw body."""

from __future__ import annotations

import numpy as np
import pytest

import objckpt
from objckpt.errors import StorePermissionError
from objckpt.storage.errors import service_detail

RAW_BODY_MARKS = ("<?xml", "<Error>", "<Code>", "Debug source", "RetryError")


def _assert_clean(message: str, secret: str) -> None:
    for mark in RAW_BODY_MARKS:
        assert mark not in message, message
    assert secret not in message
    assert not message.rstrip().endswith(":"), message


@pytest.mark.parametrize("backend", ["obstore", "fsspec"])
def test_wrong_secret_shows_the_error_code_and_message_only(s3_service, backend):
    url = s3_service.url(f"wrong-secret-{backend}")
    good = s3_service.storage_options()
    objckpt.save(url, {"w": np.zeros(4, np.float32)}, storage_options=good)
    secret = "wrong-secret-Zq9xV2"
    bad = {**good, "secret": secret, "objckpt_backend": backend}
    with pytest.raises(StorePermissionError) as err:
        objckpt.restore(url, storage_options=bad)  # GET manifest.json: an XML error body
    message = str(err.value)
    _assert_clean(message, secret)
    assert "SignatureDoesNotMatch" in message and "signature we calculated does not match" in message
    with pytest.raises(StorePermissionError) as err:
        objckpt.save(s3_service.url(f"wrong-secret-new-{backend}"), {"w": np.zeros(4)}, storage_options=bad)
    _assert_clean(str(err.value), secret)  # HEAD: a 403 with no body
    assert "403" in str(err.value)


def test_gcs_json_error_body_becomes_status_and_message():
    text = (
        'GET https://storage.googleapis.com/b/o failed: 403 Forbidden: {"error": {"code": 403, '
        '"message": "Anonymous caller does not have storage.objects.get access", "status": "PERMISSION_DENIED"}}'
    )
    detail = service_detail(text)
    assert detail.endswith(
        "403 Forbidden: PERMISSION_DENIED: Anonymous caller does not have storage.objects.get access"
    )
    assert "{" not in detail
