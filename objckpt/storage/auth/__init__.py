"""Credentials: resolving S3 sources with botocore's chain and checking that any exist
(:mod:`.credentials`), and the one refreshable Google credential of a GCS store (:mod:`.gcs`).
"""
