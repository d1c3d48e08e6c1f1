"""Server-side copies between stores: when a copy may run inside the service
(:mod:`.server`) and the S3 copy itself (:mod:`.s3`).
"""
