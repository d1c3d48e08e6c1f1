"""What objckpt speaks over plain HTTP itself: streamed range readers (:mod:`.reader`, with
S3 and GCS signing in :mod:`.s3` and :mod:`.gcs`), the GCS media uploader, and the TLS and
proxy settings every client shares (:mod:`.network`).
"""
